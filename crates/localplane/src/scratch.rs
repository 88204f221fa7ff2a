//! A lone etcd on loopback for tests and benchmarks of code that talks to etcd directly
//! (the backup engine): plain HTTP on a free port, a data directory of its own, stopped (and
//! its directory removed) when dropped or when the process that started it dies. It sends
//! nothing off the machine and trusts every local client, so it holds test data only.

use std::time::Duration;

use nestplane_runtime::binaries;
use nestplane_runtime::child::{Child, Spec};

use crate::{Error, free_port, io_err};

/// A running scratch etcd.
pub struct ScratchEtcd {
    // Dropped before the directory: the process stops, then its data goes.
    child: Child,
    url: String,
    dir: tempfile::TempDir,
}

impl ScratchEtcd {
    /// Start one and wait until it answers; returns it and a client of it.
    pub async fn start() -> Result<(ScratchEtcd, etcd_client::Client), Error> {
        let program = binaries::etcd("etcd")?;
        let dir = tempfile::tempdir().map_err(io_err("making etcd's directory"))?;
        let url = format!("http://127.0.0.1:{}", free_port()?);
        let peer = format!("http://127.0.0.1:{}", free_port()?);
        let spec = Spec {
            name: "scratch-etcd".into(),
            program,
            args: vec![
                "--name=scratch".into(),
                format!("--data-dir={}", dir.path().join("data").display()),
                format!("--listen-client-urls={url}"),
                format!("--advertise-client-urls={url}"),
                format!("--listen-peer-urls={peer}"),
                format!("--initial-advertise-peer-urls={peer}"),
                format!("--initial-cluster=scratch={peer}"),
                // As the management plane's etcd: no fsync (the data is a test's).
                "--unsafe-no-fsync=true".into(),
                "--log-level=warn".into(),
            ],
            log: dir.path().join("etcd.log"),
            ..Spec::default()
        };
        let child = Child::spawn(&spec).map_err(io_err("starting a scratch etcd"))?;
        let etcd = ScratchEtcd { child, url, dir };
        let opts = etcd_client::ConnectOptions::new()
            .with_connect_timeout(Duration::from_secs(1))
            .with_timeout(Duration::from_secs(10));
        for _ in 0..150 {
            if let Ok(mut c) =
                etcd_client::Client::connect([etcd.url.as_str()], Some(opts.clone())).await
                && c.status().await.is_ok()
            {
                return Ok((etcd, c));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let log = etcd.dir.path().join("etcd.log");
        Err(Error::ProcessFailed {
            process: "etcd".into(),
            reason: "no answer within 15 s".into(),
            tail: nestplane_runtime::child::log_tail(&log, 25),
            log: log.display().to_string(),
        })
    }

    /// Its client URL.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Its process ID.
    pub fn pid(&self) -> u32 {
        self.child.pid()
    }
}
