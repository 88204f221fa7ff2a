//! Service-account keys: key IDs as Kubernetes computes them, the public keys of a bundle,
//! and the key ID a token names. Pure.

use base64::Engine as _;
use rcgen::KeyPair;
use sha2::{Digest, Sha256};

use crate::PkiError;

fn parse(what: &'static str, reason: impl ToString) -> PkiError {
    PkiError::Parse {
        what,
        reason: reason.to_string(),
    }
}

/// The `kid` Kubernetes puts in the tokens a key signs: the SHA-256 of the public key's
/// PKIX (DER) form, base64url without padding.
pub fn service_account_key_id(public_pem: &str) -> Result<String, PkiError> {
    let (_, pem) = x509_parser::pem::parse_x509_pem(public_pem.as_bytes())
        .map_err(|e| parse("a public key PEM", e))?;
    if pem.label != "PUBLIC KEY" {
        return Err(parse("a public key PEM", format!("a {} block", pem.label)));
    }
    Ok(base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(Sha256::digest(&pem.contents)))
}

/// The public key (PEM) of a service-account private key.
pub fn service_account_public_key(key_pem: &str) -> Result<String, PkiError> {
    KeyPair::from_pem(key_pem)
        .map(|k| k.public_key_pem())
        .map_err(|e| parse("a private key", e))
}

/// Each block of `bundle` (what `--service-account-key-file` reads), as a `PUBLIC KEY` PEM.
/// Any other block (a certificate, an RSA key) or an unreadable one is an error: a rotation
/// rewrites the bundle and must not drop what it does not understand.
pub fn public_keys(bundle: &str) -> Result<Vec<String>, PkiError> {
    blocks(bundle, "PUBLIC KEY", "a public key bundle")
}

/// Each block of `bundle`, re-encoded as a `label` PEM; a block of another label or an
/// unreadable one is an error.
pub(crate) fn blocks(
    bundle: &str,
    label: &str,
    what: &'static str,
) -> Result<Vec<String>, PkiError> {
    let mut out = Vec::new();
    for pem in x509_parser::pem::Pem::iter_from_buffer(bundle.as_bytes()) {
        let pem = pem.map_err(|e| parse(what, e))?;
        if pem.label != label {
            return Err(parse(what, format!("it holds a {} block", pem.label)));
        }
        let body = base64::engine::general_purpose::STANDARD.encode(&pem.contents);
        let lines: Vec<&str> = body
            .as_bytes()
            .chunks(64)
            .map(|c| std::str::from_utf8(c).unwrap_or_default())
            .collect();
        out.push(format!(
            "-----BEGIN {label}-----\n{}\n-----END {label}-----\n",
            lines.join("\n")
        ));
    }
    Ok(out)
}

/// The key ID (`kid`) in the header of a JSON web token, if it names one. The signature is
/// not checked: this says which key signed, not whether the token is valid.
pub fn token_key_id(token: &str) -> Option<String> {
    let header = token.trim().split('.').next()?;
    let json = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(header.trim_end_matches('='))
        .ok()?;
    let v: serde_json::Value = serde_json::from_slice(&json).ok()?;
    v.get("kid")?.as_str().map(str::to_string)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn a_bundle_splits_into_its_keys_each_with_its_own_id() {
        let a = crate::generate_service_account_key().unwrap();
        let b = crate::generate_service_account_key().unwrap();
        let bundle = format!("{}{}", b.cert_pem, a.cert_pem);
        let keys = public_keys(&bundle).unwrap();
        assert_eq!(keys.len(), 2);
        let ids: Vec<String> = keys
            .iter()
            .map(|k| service_account_key_id(k).unwrap())
            .collect();
        assert_eq!(ids[0], service_account_key_id(&b.cert_pem).unwrap());
        assert_eq!(ids[1], service_account_key_id(&a.cert_pem).unwrap());
        assert_ne!(ids[0], ids[1]);
        // 32 bytes of SHA-256, base64url without padding.
        assert_eq!(ids[0].len(), 43);
        assert!(!ids[0].contains('=') && !ids[0].contains('+') && !ids[0].contains('/'));
        // The public key of the private key is the one generated with it.
        assert_eq!(
            service_account_key_id(&service_account_public_key(&a.key_pem).unwrap()).unwrap(),
            ids[1]
        );
        // A certificate is not a public key.
        let ca = crate::generate_ca("x", time::OffsetDateTime::now_utc()).unwrap();
        assert!(service_account_key_id(&ca.cert_pem).is_err());
        assert!(public_keys(&ca.cert_pem).is_err());
        assert!(public_keys(&format!("{}{}", a.cert_pem, ca.cert_pem)).is_err());
        assert_eq!(public_keys("").unwrap(), Vec::<String>::new());
    }

    #[test]
    fn the_key_id_of_a_token_is_read_from_its_header() {
        let enc = |s: &str| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(s);
        let token = format!(
            "{}.{}.sig",
            enc(r#"{"alg":"ES256","kid":"abc_-1"}"#),
            enc(r#"{"sub":"x"}"#)
        );
        assert_eq!(token_key_id(&token).as_deref(), Some("abc_-1"));
        let no_kid = format!("{}.{}.sig", enc(r#"{"alg":"ES256"}"#), enc("{}"));
        assert_eq!(token_key_id(&no_kid), None);
        assert_eq!(token_key_id("not a token"), None);
        assert_eq!(token_key_id(""), None);
    }
}
