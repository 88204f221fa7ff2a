//! The server name a TLS client asks for, read from its ClientHello without terminating TLS
//! (RFC 8446 §4.1.2, RFC 6066 §3). Pure: bytes in, a verdict out.

/// The most of a ClientHello that is read (a larger one is refused): TLS allows 16 KiB per
/// record, and a hello of several records is reassembled up to this.
pub const MAX_HELLO: usize = 32 * 1024;

/// What the first bytes of a connection say.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Hello {
    /// More bytes are needed.
    Incomplete,
    /// A ClientHello naming this server (lowercase, without a trailing dot).
    Sni(String),
    /// A ClientHello without a usable server name (none, an IP address, not a DNS name).
    NoName,
    /// Not a TLS ClientHello, or malformed, or larger than [`MAX_HELLO`].
    NotTls,
}

/// The most records a hello may span (real ones take one or two).
pub const MAX_RECORDS: usize = 4;

/// Whether the last `added` bytes of `buf` completed a record (or made it more than a
/// hello may be): only then is [`parse`] worth calling. Walks the record headers only.
pub fn record_completed(buf: &[u8], added: usize) -> bool {
    let before = buf.len() - added.min(buf.len());
    let mut at = 0;
    while let Some(h) = buf.get(at..at + 5) {
        if h[0] != 0x16 {
            // No handshake record: for the parser to refuse.
            return true;
        }
        let end = at + 5 + u16::from_be_bytes([h[3], h[4]]) as usize;
        if end > buf.len() {
            return buf.len() > MAX_HELLO;
        }
        if end > before {
            return true;
        }
        at = end;
    }
    // A header cut short is completed by a later read; bytes that are no record at all are
    // for the parser to refuse.
    buf.first().is_some_and(|b| *b != 0x16)
}

/// Read `buf` (the connection's first bytes) as TLS records carrying a ClientHello.
pub fn parse(buf: &[u8]) -> Hello {
    // Reassemble the handshake from its records.
    let mut handshake = Vec::new();
    let mut at = 0;
    let mut records = 0;
    loop {
        records += 1;
        if records > MAX_RECORDS {
            return Hello::NotTls;
        }
        let Some(header) = buf.get(at..at + 5) else {
            return if buf.len() > MAX_HELLO {
                Hello::NotTls
            } else {
                Hello::Incomplete
            };
        };
        // A handshake record of TLS 1.0–1.3 (the record layer says 3.x).
        if header[0] != 0x16 || header[1] != 3 {
            return Hello::NotTls;
        }
        let len = u16::from_be_bytes([header[3], header[4]]) as usize;
        if len == 0 || len > 16 * 1024 + 256 {
            return Hello::NotTls;
        }
        let Some(body) = buf.get(at + 5..at + 5 + len) else {
            return if at + 5 + len > MAX_HELLO {
                Hello::NotTls
            } else {
                Hello::Incomplete
            };
        };
        handshake.extend_from_slice(body);
        at += 5 + len;
        if handshake.len() >= 4 {
            if handshake[0] != 1 {
                return Hello::NotTls;
            }
            let need =
                4 + u32::from_be_bytes([0, handshake[1], handshake[2], handshake[3]]) as usize;
            if need > MAX_HELLO {
                return Hello::NotTls;
            }
            if handshake.len() >= need {
                return client_hello(&handshake[4..need]);
            }
        }
    }
}

/// A cursor over a ClientHello's fields; every read is checked.
struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let (head, rest) = (self.0.get(..n)?, self.0.get(n..)?);
        self.0 = rest;
        Some(head)
    }
    fn u8(&mut self) -> Option<usize> {
        self.take(1).map(|b| b[0] as usize)
    }
    fn u16(&mut self) -> Option<usize> {
        self.take(2)
            .map(|b| u16::from_be_bytes([b[0], b[1]]) as usize)
    }
    fn vec8(&mut self) -> Option<&'a [u8]> {
        let n = self.u8()?;
        self.take(n)
    }
    fn vec16(&mut self) -> Option<&'a [u8]> {
        let n = self.u16()?;
        self.take(n)
    }
}

fn client_hello(body: &[u8]) -> Hello {
    let mut r = Reader(body);
    let fields = (|| {
        r.take(2)?; // legacy_version
        r.take(32)?; // random
        r.vec8()?; // legacy_session_id
        r.vec16()?; // cipher_suites
        r.vec8()?; // legacy_compression_methods
        if r.0.is_empty() {
            return Some(None); // no extensions at all
        }
        let mut exts = Reader(r.vec16()?);
        while !exts.0.is_empty() {
            let kind = exts.u16()?;
            let data = exts.vec16()?;
            if kind == 0 {
                return Some(Some(data));
            }
        }
        Some(None)
    })();
    match fields {
        None => Hello::NotTls,
        Some(None) => Hello::NoName,
        Some(Some(data)) => server_name(data),
    }
}

fn server_name(data: &[u8]) -> Hello {
    let mut r = Reader(data);
    let Some(list) = r.vec16() else {
        return Hello::NotTls;
    };
    let mut list = Reader(list);
    while !list.0.is_empty() {
        let (Some(kind), Some(name)) = (list.u8(), list.vec16()) else {
            return Hello::NotTls;
        };
        if kind != 0 {
            continue;
        }
        let Ok(name) = std::str::from_utf8(name) else {
            return Hello::NoName;
        };
        let name = name.trim_end_matches('.').to_ascii_lowercase();
        let dns = !name.is_empty()
            && name.len() <= 253
            && name.split('.').all(|l| {
                !l.is_empty()
                    && l.len() <= 63
                    && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
            });
        return if dns { Hello::Sni(name) } else { Hello::NoName };
    }
    Hello::NoName
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A ClientHello with `extensions`, in one record.
    fn hello(extensions: &[u8]) -> Vec<u8> {
        let mut body = vec![3, 3];
        body.extend([7u8; 32]);
        body.push(0); // session id
        body.extend([0, 2, 0x13, 0x01]); // one cipher suite
        body.extend([1, 0]); // null compression
        body.extend((extensions.len() as u16).to_be_bytes());
        body.extend(extensions);
        let mut hs = vec![1];
        hs.extend(&(body.len() as u32).to_be_bytes()[1..]);
        hs.extend(body);
        let mut rec = vec![0x16, 3, 1];
        rec.extend((hs.len() as u16).to_be_bytes());
        rec.extend(hs);
        rec
    }

    fn sni_ext(name: &[u8]) -> Vec<u8> {
        let mut entry = vec![0];
        entry.extend((name.len() as u16).to_be_bytes());
        entry.extend(name);
        let mut list = (entry.len() as u16).to_be_bytes().to_vec();
        list.extend(entry);
        let mut ext = vec![0, 0];
        ext.extend((list.len() as u16).to_be_bytes());
        ext.extend(list);
        ext
    }

    #[test]
    fn the_name_is_read_from_any_prefix_that_holds_it() {
        let mut exts = vec![0, 10, 0, 2, 0, 29]; // another extension first
        exts.extend(sni_ext(b"Demo.Default.Nestplane.Internal."));
        let rec = hello(&exts);
        assert_eq!(
            parse(&rec),
            Hello::Sni("demo.default.nestplane.internal".into())
        );
        for cut in 0..rec.len() {
            assert_eq!(parse(&rec[..cut]), Hello::Incomplete, "at {cut}");
        }
    }

    #[test]
    fn a_hello_split_over_records_is_reassembled() {
        let rec = hello(&sni_ext(b"a.b"));
        let hs = &rec[5..];
        let (one, two) = hs.split_at(20);
        let mut split = Vec::new();
        for part in [one, two] {
            split.extend([0x16, 3, 3]);
            split.extend((part.len() as u16).to_be_bytes());
            split.extend(part);
        }
        assert_eq!(parse(&split), Hello::Sni("a.b".into()));
    }

    #[test]
    fn anything_else_is_no_name_or_not_tls() {
        assert_eq!(parse(&hello(&[])), Hello::NoName);
        assert_eq!(parse(&hello(&sni_ext(b"bad_name.x"))), Hello::NoName);
        assert_eq!(parse(&hello(&sni_ext(b"a..b"))), Hello::NoName);
        assert_eq!(parse(&hello(&sni_ext(&[0xff, 0xfe]))), Hello::NoName);
        assert_eq!(parse(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"), Hello::NotTls);
        // A record claiming more than TLS allows, a handshake that is no ClientHello, a
        // truncated extension list.
        assert_eq!(parse(&[0x16, 3, 1, 0xff, 0xff, 1]), Hello::NotTls);
        let mut server_hello = hello(&[]);
        server_hello[5] = 2;
        assert_eq!(parse(&server_hello), Hello::NotTls);
        let mut bad = hello(&sni_ext(b"a.b"));
        let n = bad.len();
        bad[n - 7] = 0x40; // the name list's length now runs past the end
        assert_eq!(parse(&bad), Hello::NotTls);
        // Endless records that never finish a hello: refused at MAX_HELLO.
        let mut endless = Vec::new();
        let mut first = vec![1, 0xff, 0xff, 0xff];
        first.resize(16 * 1024, 0);
        endless.extend([0x16, 3, 3, 0x40, 0x00]);
        endless.extend(&first);
        assert_eq!(
            parse(&endless),
            Hello::NotTls,
            "a hello larger than MAX_HELLO"
        );
        // Many small records of a hello that says it is small enough: refused at
        // MAX_RECORDS, never reassembled without end.
        let mut many = Vec::new();
        let mut first = vec![1, 0, 0x40, 0];
        first.resize(16, 0);
        for part in std::iter::once(&first[..]).chain(std::iter::repeat_n(&[0u8; 16][..], 8)) {
            many.extend([0x16, 3, 3, 0, part.len() as u8]);
            many.extend(part);
        }
        assert_eq!(parse(&many), Hello::NotTls);
    }

    #[test]
    fn parsing_waits_for_a_record_to_complete() {
        let rec = hello(&sni_ext(b"a.b"));
        // Byte by byte: only the last byte completes the record.
        for n in 1..rec.len() {
            assert!(!record_completed(&rec[..n], 1), "at {n}");
        }
        assert!(record_completed(&rec, 1));
        assert!(record_completed(&rec, rec.len()));
        // Plain text is handed to the parser at once (to be refused).
        assert!(record_completed(b"GET /", 5));
    }
}
