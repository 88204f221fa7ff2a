//! Child processes that never outlive their parent.
//!
//! Every process nestplane starts (management plane or tenant component) is spawned here: its
//! output goes to a log file, it receives `SIGKILL` when the spawning thread's process dies
//! (`PR_SET_PDEATHSIG`), and dropping the handle kills and reaps it. So a test that panics or a
//! `nestplane up` that is killed leaves nothing running.

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::{self, Read, Seek, SeekFrom};
use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// What to run.
#[derive(Clone, Debug, Default)]
pub struct Spec {
    /// A short name for messages (`etcd`, `kube-apiserver`, `demo-etcd-0`, …).
    pub name: String,
    /// The program to execute.
    pub program: PathBuf,
    /// Its arguments.
    pub args: Vec<String>,
    /// Extra environment variables.
    pub env: BTreeMap<String, String>,
    /// Where stdout and stderr go (appended).
    pub log: PathBuf,
    /// Working directory.
    pub cwd: Option<PathBuf>,
    /// Run as this user (and group, with no supplementary groups) instead of the caller's. The
    /// working directory is entered before the switch, so the user needs no access to the
    /// directories above it: paths in `args` go through it (`/proc/self/cwd/…`).
    pub user: Option<crate::user::User>,
    /// How long a stop waits after SIGTERM before it kills (5 s when `None`).
    pub stop_grace: Option<std::time::Duration>,
}

/// Build the `Command` for `spec`, with output appended to the log and the parent-death
/// signal set.
///
/// With a user, the program is opened here and executed through its descriptor
/// (`/proc/self/fd/N`, `argv[0]` its path): the user needs no access to the directories that
/// hold it (a binary cache under `/root`). The returned file must live until the command is
/// spawned.
pub fn command(spec: &Spec) -> io::Result<(Command, Option<File>)> {
    if let Some(dir) = spec.log.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let log = OpenOptions::new()
        .create(true)
        .append(true)
        .open(&spec.log)?;
    let (mut cmd, exe) = match spec.user {
        Some(_) => {
            let exe = File::open(&spec.program).map_err(|e| {
                io::Error::new(e.kind(), format!("opening {}: {e}", spec.program.display()))
            })?;
            let mut cmd = Command::new(format!("/proc/self/fd/{}", exe.as_raw_fd()));
            cmd.arg0(&spec.program);
            (cmd, Some(exe))
        }
        None => (Command::new(&spec.program), None),
    };
    cmd.args(&spec.args)
        .envs(&spec.env)
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log);
    let user = spec.user;
    let enter = match (&spec.cwd, user) {
        (Some(cwd), Some(_)) => Some(
            std::ffi::CString::new(cwd.as_os_str().as_encoded_bytes())
                .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?,
        ),
        (Some(cwd), None) => {
            cmd.current_dir(cwd);
            None
        }
        (None, _) => None,
    };
    // SAFETY: the closure runs between fork and exec, so it may only make async-signal-safe
    // system calls and must not allocate: rustix's calls below are single system calls (the
    // user switch is per thread, and the child has one thread), the directory's C string is
    // made before the fork, and close_range (which rustix lacks) is a raw syscall. The
    // parent-death signal makes the kernel kill the child when the spawning thread's process
    // dies, so no tenant process or management-plane process outlives a crashed operator or
    // test; it is set after the user switch, which would clear it.
    #[allow(unsafe_code)]
    unsafe {
        cmd.pre_exec(move || {
            use rustix::process::{Pid, Signal, getppid, set_parent_process_death_signal};
            use rustix::thread::{
                set_no_new_privs, set_thread_gid, set_thread_groups, set_thread_uid,
            };
            if let Some(dir) = &enter {
                rustix::process::chdir(dir.as_c_str())?;
            }
            if user.is_some() {
                // No descriptor the operator inherited reaches a tenant's process (a kernel
                // without close_range keeps them; nestplane's own are close-on-exec anyway).
                libc::syscall(
                    libc::SYS_close_range,
                    3u32,
                    u32::MAX,
                    libc::CLOSE_RANGE_CLOEXEC,
                );
            }
            if let Some(u) = user {
                set_thread_groups(&[])?;
                set_thread_gid(rustix::process::Gid::from_raw(u.gid))?;
                set_thread_uid(rustix::process::Uid::from_raw(u.uid))?;
                set_no_new_privs(true)?;
            }
            set_parent_process_death_signal(Some(Signal::KILL))?;
            // The parent may have died between fork and prctl.
            if getppid() == Some(Pid::INIT) {
                return Err(io::Error::other("parent exited before the child started"));
            }
            Ok(())
        });
    }
    Ok((cmd, exe))
}

/// A running child process; dropping it kills and reaps it.
#[derive(Debug)]
pub struct Child {
    name: String,
    log: PathBuf,
    child: std::process::Child,
}

impl Child {
    /// Start `spec`.
    pub fn spawn(spec: &Spec) -> io::Result<Child> {
        let (mut cmd, _exe) = command(spec)?;
        let child = cmd.spawn().map_err(|e| {
            io::Error::new(
                e.kind(),
                format!(
                    "cannot start {} ({}): {e}",
                    spec.name,
                    spec.program.display()
                ),
            )
        })?;
        Ok(Child {
            name: spec.name.clone(),
            log: spec.log.clone(),
            child,
        })
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The name given at spawn.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The log file.
    pub fn log(&self) -> &Path {
        &self.log
    }

    /// `Some(status)` once the process has exited.
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    /// Kill (SIGKILL) and reap.
    pub fn kill(&mut self) {
        // Best effort: the process may be gone already.
        let _ = self.child.kill();
        // Best effort: the process may be gone already.
        let _ = self.child.wait();
    }

    /// Ask the process to stop (SIGTERM), wait up to `grace`, then kill it.
    pub fn stop(&mut self, grace: std::time::Duration) {
        if self.exited().is_some() {
            return;
        }
        terminate(self.child.id());
        let deadline = std::time::Instant::now() + grace;
        while std::time::Instant::now() < deadline {
            if self.exited().is_some() {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        self.kill();
    }
}

impl Drop for Child {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Send SIGTERM to `pid`.
pub fn terminate(pid: u32) {
    signal(pid, rustix::process::Signal::TERM);
}

/// Send SIGKILL to `pid`.
pub fn kill_pid(pid: u32) {
    signal(pid, rustix::process::Signal::KILL);
}

/// Send `sig` to the process `pid` (never to a group: 0 and values past `i32::MAX` name no
/// process).
fn signal(pid: u32, sig: rustix::process::Signal) {
    if let Some(pid) = i32::try_from(pid)
        .ok()
        .and_then(rustix::process::Pid::from_raw)
    {
        // Best effort: the process may be gone already.
        let _ = rustix::process::kill_process(pid, sig);
    }
}

/// The last `lines` lines of a log file (for error messages).
pub fn log_tail(path: &Path, lines: usize) -> String {
    let Ok(mut f) = File::open(path) else {
        return format!("(no log at {})", path.display());
    };
    let len = f.metadata().map(|m| m.len()).unwrap_or(0);
    let start = len.saturating_sub(16 * 1024);
    // Best effort: reading from the start shows more, never less.
    let _ = f.seek(SeekFrom::Start(start));
    let mut buf = String::new();
    let mut bytes = Vec::new();
    if f.read_to_end(&mut bytes).is_ok() {
        buf = String::from_utf8_lossy(&bytes).into_owned();
    }
    let all: Vec<&str> = buf.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}
