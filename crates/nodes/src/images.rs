//! Container images built on this machine, nothing pulled.
//!
//! [`catalog`] (pure) says what each image holds: a root filesystem made of files taken from
//! this machine (static Kubernetes binaries, Debian's etcd and busybox, the `nestplane`
//! binary) with the shared libraries they need, an entrypoint and environment. [`build`] stages
//! each root filesystem, hashes it, and only when the hash changed runs `buildah` to commit the
//! image and write it as an OCI archive (`<dir>/<name>.oci.tar`); nodes import the archives
//! into their own containerd ([`crate::node`]).
//!
//! Images carry the names a real cluster pulls (`registry.k8s.io/kube-apiserver:v1.20.2`,
//! `registry.k8s.io/etcd:3.4.13-0`, …) so the manifests nestplane renders are the same here and
//! in production.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;

use sha2::{Digest, Sha256};

use crate::Error;

/// The pause image Kubernetes 1.20's kubelet and containerd use for pod sandboxes.
pub const PAUSE_TAG: &str = "3.2";

/// The shell image tests and users run in pods.
pub const SHELL_IMAGE: &str = "docker.io/library/busybox:1.35";

/// The operator image `config/manager/manager.yaml` names (`nestplane:latest`, as containerd
/// normalises it).
pub const OPERATOR_IMAGE: &str = "docker.io/library/nestplane:latest";

/// The end-to-end suite's test server (Kubernetes 1.20's name for it): webhooks, conversion,
/// `netexec`, `porter`, `pause` (its default command)…
pub const AGNHOST_IMAGE: &str = "k8s.gcr.io/e2e-test-images/agnhost:2.21";

/// The sample aggregated API server the suite installs behind an `APIService`.
pub const SAMPLE_APISERVER_IMAGE: &str = "gcr.io/kubernetes-e2e-test-images/sample-apiserver:1.17";

/// The end-to-end suite's images beyond agnhost and the sample API server, under the names
/// Kubernetes 1.20's suite asks for (`test/utils/image/manifest.go`), built with
/// [`Options::suite`] for `make conformance`. The web servers answer on port 80 from the
/// document root the upstream image has (busybox's `httpd`).
pub const SUITE_IMAGES: [&str; 10] = [
    "docker.io/library/busybox:1.29",
    "docker.io/library/httpd:2.4.38-alpine",
    "docker.io/library/httpd:2.4.39-alpine",
    "docker.io/library/nginx:1.14-alpine",
    "docker.io/library/nginx:1.15-alpine",
    "gcr.io/kubernetes-e2e-test-images/nonewprivs:1.0",
    "gcr.io/kubernetes-e2e-test-images/kitten:1.0",
    "gcr.io/kubernetes-e2e-test-images/nautilus:1.0",
    "gcr.io/kubernetes-e2e-test-images/jessie-dnsutils:1.0",
    "gcr.io/kubernetes-e2e-test-images/nonroot:1.0",
];

/// Tools the suite's specs run in its images, taken from this machine with their libraries
/// (name, path in the image). Debian's static busybox runs its own applets before `PATH`
/// when it is the shell, so the shell is bash, and these are not linked to busybox.
pub const REAL_TOOLS: [(&str, &str); 5] = [
    ("bash", "/bin/bash"),
    ("curl", "/usr/bin/curl"),
    ("dig", "/usr/bin/dig"),
    ("nc", "/usr/bin/nc"),
    ("getent", "/usr/bin/getent"),
];

/// Names and versions of the images to build.
#[derive(Clone, Debug)]
pub struct Options {
    /// Registry of the Kubernetes images (`registry.k8s.io`); the operator's
    /// `--image-registry` must name the same one.
    pub registry: String,
    /// Kubernetes version (`v1.20.2`).
    pub version: String,
    /// etcd's image tag for that version (`3.4.13-0`).
    pub etcd_tag: String,
    /// Also the end-to-end suite's other images ([`SUITE_IMAGES`]).
    pub suite: bool,
}

/// Where the files that go into images are on this machine.
#[derive(Clone, Debug)]
pub struct Inputs {
    /// kube-apiserver, kube-controller-manager, kube-scheduler, kube-proxy (static).
    pub kubernetes: BTreeMap<String, PathBuf>,
    /// Debian's `etcd` and `etcdctl` (dynamically linked).
    pub etcd: PathBuf,
    /// `etcdctl`.
    pub etcdctl: PathBuf,
    /// The pause binary, compiled by [`build_pause`].
    pub pause: PathBuf,
    /// The `nestplane` binary for the operator image (`None`: no operator image).
    pub nestplane: Option<PathBuf>,
    /// The project's `Containerfile` for the operator image.
    pub containerfile: Option<PathBuf>,
    /// A static busybox.
    pub busybox: PathBuf,
    /// Applets to link to busybox in the shell image.
    pub busybox_applets: Vec<String>,
    /// The end-to-end suite's servers, built from the Kubernetes source tree
    /// (`agnhost`, `sample-apiserver`, `nonewprivs`; static), and the files its images carry
    /// (`localhost.crt`, `localhost.key`, the `kitten` and `nautilus` pages' directories).
    pub e2e: BTreeMap<String, PathBuf>,
    /// The [`REAL_TOOLS`] on this machine, by name.
    pub tools: BTreeMap<String, PathBuf>,
}

/// One entry of an image's root filesystem.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Entry {
    /// Copy a file from this machine; with `libs`, also the shared libraries it loads (found
    /// with `ldd`) at their own paths.
    File {
        /// Source on this machine.
        src: PathBuf,
        /// Absolute path in the image.
        dst: String,
        /// Copy its shared libraries too.
        libs: bool,
    },
    /// Copy a whole directory (xtables extensions).
    Dir {
        /// Source on this machine.
        src: PathBuf,
        /// Absolute path in the image.
        dst: String,
    },
    /// A symbolic link.
    Symlink {
        /// What it points to.
        target: String,
        /// Absolute path in the image.
        link: String,
    },
    /// An empty directory.
    EmptyDir(String),
    /// A file with these contents.
    Text {
        /// Absolute path in the image.
        dst: String,
        /// Its contents.
        contents: String,
    },
    /// Set the mode of a path laid out by an earlier entry (`0o4755`: set-user-ID).
    Mode {
        /// Absolute path in the image.
        path: String,
        /// The mode.
        mode: u32,
    },
}

/// One image to build.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ImageSpec {
    /// Full reference (`registry.k8s.io/kube-apiserver:v1.20.2`).
    pub name: String,
    /// Root filesystem.
    pub entries: Vec<Entry>,
    /// Entrypoint (empty: none, pods give a command).
    pub entrypoint: Vec<String>,
    /// Default arguments to the entrypoint (what pods' `args` replace).
    pub cmd: Vec<String>,
    /// Environment.
    pub env: Vec<(String, String)>,
    /// Built with `buildah bud` from this Containerfile, the staged root filesystem as
    /// `rootfs/` in the context (the operator image); otherwise committed directly.
    pub containerfile: Option<PathBuf>,
    /// The user its processes run as unless a pod says otherwise (`None`: root).
    pub user: Option<String>,
}

const PATH_ENV: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

fn bin(src: &Path, dst: &str, libs: bool) -> Entry {
    Entry::File {
        src: src.to_path_buf(),
        dst: dst.into(),
        libs,
    }
}

fn path_env() -> Vec<(String, String)> {
    vec![("PATH".into(), PATH_ENV.into())]
}

/// busybox with a link for each applet but busybox itself and `skip`, and `/tmp`.
fn busybox_entries(inputs: &Inputs, skip: &[&str]) -> Vec<Entry> {
    let mut e = vec![bin(&inputs.busybox, "/bin/busybox", false)];
    for a in &inputs.busybox_applets {
        if a != "busybox" && !skip.contains(&a.as_str()) {
            e.push(Entry::Symlink {
                target: "/bin/busybox".into(),
                link: format!("/bin/{a}"),
            });
        }
    }
    e.push(Entry::EmptyDir("/tmp".into()));
    // Writable by any user, as on any machine (nonroot runs as 1234).
    e.push(Entry::Mode {
        path: "/tmp".into(),
        mode: 0o1777,
    });
    e
}

/// The shell image's root filesystem: busybox and its applets.
fn shell(inputs: &Inputs) -> Vec<Entry> {
    busybox_entries(inputs, &[])
}

/// busybox's applets behind the [`REAL_TOOLS`] found on this machine; bash is the shell.
fn toolbox(inputs: &Inputs) -> Vec<Entry> {
    let real: Vec<&str> = REAL_TOOLS
        .iter()
        .filter(|(n, _)| inputs.tools.contains_key(*n))
        .map(|(n, _)| *n)
        .collect();
    let bash = real.contains(&"bash");
    let mut skip = real.clone();
    if bash {
        skip.push("sh");
    }
    let mut e = busybox_entries(inputs, &skip);
    for (name, dst) in REAL_TOOLS {
        if let Some(src) = inputs.tools.get(name) {
            e.push(bin(src, dst, true));
        }
    }
    if bash {
        e.push(Entry::Symlink {
            target: "bash".into(),
            link: "/bin/sh".into(),
        });
    }
    e
}

/// agnhost as upstream's image has it: the tools, porter's certificate and key at the root
/// (its TLS ports), `/uploads` (netexec), the `agnhost-2` link.
fn agnhost_entries(agnhost: &Path, inputs: &Inputs) -> Vec<Entry> {
    let mut e = toolbox(inputs);
    e.push(bin(agnhost, "/agnhost", false));
    e.push(Entry::Symlink {
        target: "agnhost".into(),
        link: "/agnhost-2".into(),
    });
    e.push(Entry::EmptyDir("/uploads".into()));
    for f in ["localhost.crt", "localhost.key"] {
        if let Some(src) = inputs.e2e.get(f) {
            e.push(bin(src, &format!("/{f}"), false));
        }
    }
    e
}

/// The [`SUITE_IMAGES`] whose inputs are there.
fn suite(inputs: &Inputs) -> Vec<ImageSpec> {
    let mut out = Vec::new();
    let image = |name: &str, entries: Vec<Entry>, entrypoint: &[&str], cmd: &[&str]| ImageSpec {
        name: name.into(),
        entries,
        entrypoint: entrypoint.iter().map(|s| s.to_string()).collect(),
        cmd: cmd.iter().map(|s| s.to_string()).collect(),
        env: path_env(),
        containerfile: None,
        user: None,
    };
    out.push(image(SUITE_IMAGES[0], shell(inputs), &[], &["sh"]));
    // Web servers: the document root and index page of the upstream images, port 80.
    for (name, root) in [
        (SUITE_IMAGES[1], "/usr/local/apache2/htdocs"),
        (SUITE_IMAGES[2], "/usr/local/apache2/htdocs"),
        (SUITE_IMAGES[3], "/usr/share/nginx/html"),
        (SUITE_IMAGES[4], "/usr/share/nginx/html"),
    ] {
        let mut e = shell(inputs);
        e.push(Entry::Text {
            dst: format!("{root}/index.html"),
            contents: "<html><body><h1>It works!</h1></body></html>\n".into(),
        });
        out.push(image(
            name,
            e,
            &[],
            &["/bin/busybox", "httpd", "-f", "-v", "-p", "80", "-h", root],
        ));
    }
    if let Some(nnp) = inputs.e2e.get("nonewprivs") {
        let mut e = shell(inputs);
        e.push(bin(nnp, "/usr/local/bin/nnp", false));
        e.push(Entry::Mode {
            path: "/usr/local/bin/nnp".into(),
            mode: 0o4755,
        });
        out.push(image(SUITE_IMAGES[5], e, &[], &["nnp"]));
    }
    if let Some(agnhost) = inputs.e2e.get("agnhost") {
        for (name, page) in [(SUITE_IMAGES[6], "kitten"), (SUITE_IMAGES[7], "nautilus")] {
            let Some(dir) = inputs.e2e.get(page) else {
                continue;
            };
            let mut e = agnhost_entries(agnhost, inputs);
            for f in ["data.json".to_string(), format!("{page}.jpg")] {
                e.push(bin(&dir.join(&f), &format!("/{f}"), false));
            }
            out.push(image(name, e, &["/agnhost"], &["test-webserver"]));
        }
    }
    out.push(image(SUITE_IMAGES[8], toolbox(inputs), &[], &["sh"]));
    let mut nonroot = image(SUITE_IMAGES[9], shell(inputs), &[], &["sh"]);
    nonroot.user = Some("1234".into());
    out.push(nonroot);
    out
}

/// Every image for `opts`, from `inputs`. Pure.
pub fn catalog(opts: &Options, inputs: &Inputs) -> Vec<ImageSpec> {
    let reg = opts.registry.trim_end_matches('/');
    let mut out = vec![ImageSpec {
        name: format!("{reg}/pause:{PAUSE_TAG}"),
        entries: vec![bin(&inputs.pause, "/pause", false)],
        entrypoint: vec!["/pause".into()],
        cmd: vec![],
        env: vec![],
        containerfile: None,
        user: None,
    }];
    for (name, src) in &inputs.kubernetes {
        let mut entries = vec![bin(src, &format!("/usr/local/bin/{name}"), false)];
        if name == "kube-proxy" {
            // kube-proxy's iptables mode runs iptables and conntrack.
            entries.push(bin(
                Path::new("/usr/sbin/xtables-nft-multi"),
                "/usr/sbin/xtables-nft-multi",
                true,
            ));
            for l in [
                "iptables",
                "iptables-save",
                "iptables-restore",
                "ip6tables",
                "ip6tables-save",
                "ip6tables-restore",
            ] {
                entries.push(Entry::Symlink {
                    target: "xtables-nft-multi".into(),
                    link: format!("/usr/sbin/{l}"),
                });
            }
            entries.push(Entry::Dir {
                src: "/usr/lib/x86_64-linux-gnu/xtables".into(),
                dst: "/usr/lib/x86_64-linux-gnu/xtables".into(),
            });
            entries.push(bin(
                Path::new("/usr/sbin/conntrack"),
                "/usr/sbin/conntrack",
                true,
            ));
        }
        out.push(ImageSpec {
            name: format!("{reg}/{name}:{}", opts.version),
            entries,
            entrypoint: vec![format!("/usr/local/bin/{name}")],
            cmd: vec![],
            env: path_env(),
            containerfile: None,
            user: None,
        });
    }
    out.push(ImageSpec {
        name: format!("{reg}/etcd:{}", opts.etcd_tag),
        entries: vec![
            bin(&inputs.etcd, "/usr/local/bin/etcd", true),
            bin(&inputs.etcdctl, "/usr/local/bin/etcdctl", true),
            Entry::EmptyDir("/var/lib/etcd".into()),
            Entry::EmptyDir("/tmp".into()),
        ],
        entrypoint: vec![],
        cmd: vec![],
        env: path_env(),
        containerfile: None,
        user: None,
    });
    out.push(ImageSpec {
        name: SHELL_IMAGE.into(),
        entries: shell(inputs),
        entrypoint: vec![],
        cmd: vec![],
        env: path_env(),
        containerfile: None,
        user: None,
    });
    if let Some(agnhost) = inputs.e2e.get("agnhost") {
        out.push(ImageSpec {
            name: AGNHOST_IMAGE.into(),
            entries: agnhost_entries(agnhost, inputs),
            entrypoint: vec!["/agnhost".into()],
            cmd: vec!["pause".into()],
            env: path_env(),
            containerfile: None,
            user: None,
        });
    }
    if let Some(sample) = inputs.e2e.get("sample-apiserver") {
        out.push(ImageSpec {
            name: SAMPLE_APISERVER_IMAGE.into(),
            entries: vec![
                bin(sample, "/kube-sample-apiserver", false),
                Entry::EmptyDir("/tmp".into()),
            ],
            entrypoint: vec!["/kube-sample-apiserver".into()],
            cmd: vec![],
            env: path_env(),
            containerfile: None,
            user: None,
        });
    }
    if opts.suite {
        out.extend(suite(inputs));
    }
    if let Some(np) = &inputs.nestplane {
        out.push(ImageSpec {
            name: OPERATOR_IMAGE.into(),
            entries: vec![bin(np, "/nestplane", true)],
            entrypoint: vec!["/nestplane".into()],
            cmd: vec![],
            env: vec![],
            containerfile: inputs.containerfile.clone(),
            user: None,
        });
    }
    out
}

/// The file an image's OCI archive is written to: `<dir>/<name with / and : as _>.oci.tar`.
pub fn archive_path(dir: &Path, name: &str) -> PathBuf {
    let safe: String = name
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '.' || c == '-' {
                c
            } else {
                '_'
            }
        })
        .collect();
    dir.join(format!("{safe}.oci.tar"))
}

/// What [`build`] did for one image.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Built {
    /// The image's name.
    pub name: String,
    /// Its OCI archive.
    pub archive: PathBuf,
    /// False when the archive was already up to date.
    pub rebuilt: bool,
}

fn run(cmd: &mut Command, what: &str) -> Result<String, Error> {
    let out = cmd
        .output()
        .map_err(|e| Error::io(format!("running {what}"), e))?;
    if !out.status.success() {
        return Err(Error::Command {
            what: what.into(),
            output: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Shared libraries `bin` loads, from `ldd` (empty for a static binary).
fn shared_libraries(bin: &Path) -> Result<Vec<PathBuf>, Error> {
    let out = Command::new("ldd")
        .arg(bin)
        .output()
        .map_err(|e| Error::io("running ldd", e))?;
    let text = String::from_utf8_lossy(&out.stdout);
    Ok(parse_ldd(&text))
}

/// Library paths from `ldd` output. Pure.
pub fn parse_ldd(text: &str) -> Vec<PathBuf> {
    let mut libs = Vec::new();
    for line in text.lines() {
        let line = line.trim();
        let path = match line.split_once("=>") {
            Some((_, rest)) => rest.split_whitespace().next(),
            None => line.split_whitespace().next(),
        };
        if let Some(p) = path.filter(|p| p.starts_with('/')) {
            libs.push(PathBuf::from(p));
        }
    }
    libs
}

fn copy_file(src: &Path, dst: &Path) -> Result<(), Error> {
    if let Some(d) = dst.parent() {
        std::fs::create_dir_all(d)
            .map_err(|e| Error::io(format!("creating {}", d.display()), e))?;
    }
    std::fs::copy(src, dst)
        .map_err(|e| Error::io(format!("copying {} to {}", src.display(), dst.display()), e))?;
    Ok(())
}

fn under(root: &Path, abs: &str) -> PathBuf {
    root.join(abs.trim_start_matches('/'))
}

/// Staged links point at absolute paths of the image, which are this machine's paths here:
/// writing through one would change this machine's file.
fn refuse_symlink(p: &Path) -> Result<(), Error> {
    match std::fs::symlink_metadata(p) {
        Ok(m) if m.file_type().is_symlink() => Err(Error::Command {
            what: "staging an image".into(),
            output: format!("{} is a link; not written through", p.display()),
        }),
        _ => Ok(()),
    }
}

/// Lay out `spec`'s root filesystem under `root`.
fn stage(spec: &ImageSpec, root: &Path) -> Result<(), Error> {
    for e in &spec.entries {
        match e {
            Entry::File { src, dst, libs } => {
                copy_file(src, &under(root, dst))?;
                if *libs {
                    for lib in shared_libraries(src)? {
                        let canonical = std::fs::canonicalize(&lib).unwrap_or(lib.clone());
                        copy_file(&canonical, &under(root, &lib.to_string_lossy()))?;
                    }
                }
            }
            Entry::Dir { src, dst } => {
                let rd = std::fs::read_dir(src)
                    .map_err(|e| Error::io(format!("reading {}", src.display()), e))?;
                for f in rd.flatten() {
                    let name = f.file_name();
                    copy_file(&f.path(), &under(root, dst).join(&name))?;
                }
            }
            Entry::Symlink { target, link } => {
                let l = under(root, link);
                if let Some(d) = l.parent() {
                    std::fs::create_dir_all(d)
                        .map_err(|e| Error::io(format!("creating {}", d.display()), e))?;
                }
                // Best effort: what cannot be removed now is left for the next cleanup.
                let _ = std::fs::remove_file(&l);
                std::os::unix::fs::symlink(target, &l)
                    .map_err(|e| Error::io(format!("linking {}", l.display()), e))?;
            }
            Entry::EmptyDir(d) => {
                let p = under(root, d);
                std::fs::create_dir_all(&p)
                    .map_err(|e| Error::io(format!("creating {}", p.display()), e))?;
            }
            Entry::Text { dst, contents } => {
                let p = under(root, dst);
                refuse_symlink(&p)?;
                if let Some(d) = p.parent() {
                    std::fs::create_dir_all(d)
                        .map_err(|e| Error::io(format!("creating {}", d.display()), e))?;
                }
                std::fs::write(&p, contents)
                    .map_err(|e| Error::io(format!("writing {}", p.display()), e))?;
            }
            Entry::Mode { path, mode } => {
                use std::os::unix::fs::PermissionsExt;
                let p = under(root, path);
                refuse_symlink(&p)?;
                std::fs::set_permissions(&p, std::fs::Permissions::from_mode(*mode))
                    .map_err(|e| Error::io(format!("setting the mode of {}", p.display()), e))?;
            }
        }
    }
    Ok(())
}

/// A digest of everything that makes up the image: its name, entrypoint, environment, the
/// Containerfile, and every staged file's path, mode and contents (or link target).
fn digest(spec: &ImageSpec, root: &Path) -> Result<String, Error> {
    use std::os::unix::fs::PermissionsExt;
    let mut h = Sha256::new();
    h.update(format!(
        "{}\n{:?}\n{:?}\n",
        spec.name, spec.entrypoint, spec.env
    ));
    if !spec.cmd.is_empty() {
        h.update(format!("cmd {:?}\n", spec.cmd));
    }
    if let Some(u) = &spec.user {
        h.update(format!("user {u}\n"));
    }
    if let Some(cf) = &spec.containerfile {
        h.update(std::fs::read(cf).map_err(|e| Error::io(format!("reading {}", cf.display()), e))?);
    }
    let mut stack = vec![root.to_path_buf()];
    let mut files = Vec::new();
    while let Some(dir) = stack.pop() {
        let rd = std::fs::read_dir(&dir)
            .map_err(|e| Error::io(format!("reading {}", dir.display()), e))?;
        for f in rd.flatten() {
            let p = f.path();
            let ft = f.file_type().map_err(|e| Error::io("file type", e))?;
            if ft.is_dir() {
                stack.push(p.clone());
            }
            files.push((p, ft));
        }
    }
    files.sort_by(|a, b| a.0.cmp(&b.0));
    for (p, ft) in files {
        let rel = p.strip_prefix(root).unwrap_or(&p);
        h.update(rel.to_string_lossy().as_bytes());
        if ft.is_symlink() {
            let t = std::fs::read_link(&p).map_err(|e| Error::io("reading a link", e))?;
            h.update(b"->");
            h.update(t.to_string_lossy().as_bytes());
        } else {
            let m = p.metadata().map_err(|e| Error::io("stat", e))?;
            h.update(m.permissions().mode().to_le_bytes());
        }
        if ft.is_file() {
            h.update(
                std::fs::read(&p).map_err(|e| Error::io(format!("reading {}", p.display()), e))?,
            );
        }
        h.update(b"\n");
    }
    Ok(format!("{:x}", h.finalize()))
}

/// buildah with its own storage under `dir` (nothing touches the machine's image store).
fn buildah(dir: &Path) -> Command {
    let mut c = Command::new("buildah");
    c.arg("--root")
        .arg(dir.join("storage"))
        .arg("--runroot")
        .arg(dir.join("run"))
        .arg("--storage-driver")
        .arg("vfs");
    c
}

/// Build every image of `specs` whose contents changed into OCI archives under `dir`.
/// `progress` is told about each image.
pub fn build(
    specs: &[ImageSpec],
    dir: &Path,
    progress: &mut dyn FnMut(&str),
) -> Result<Vec<Built>, Error> {
    std::fs::create_dir_all(dir)
        .map_err(|e| Error::io(format!("creating {}", dir.display()), e))?;
    // One build at a time per directory (test binaries, `up` and checkouts side by side
    // share it): the lock is released when the file closes, also when a builder dies.
    let lock = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(dir.join(".build.lock"))
        .map_err(|e| Error::io("opening the build lock", e))?;
    lock.lock()
        .map_err(|e| Error::io("taking the build lock", e))?;
    let mut out = Vec::new();
    for spec in specs {
        let archive = archive_path(dir, &spec.name);
        let work = dir.join("staging").join(
            archive
                .file_name()
                .map(|f| f.to_string_lossy().into_owned())
                .unwrap_or_default(),
        );
        // Best effort: what cannot be removed now is left for the next cleanup.
        let _ = std::fs::remove_dir_all(&work);
        let rootfs = work.join("rootfs");
        std::fs::create_dir_all(&rootfs)
            .map_err(|e| Error::io(format!("creating {}", rootfs.display()), e))?;
        stage(spec, &rootfs)?;
        let sum = digest(spec, &rootfs)?;
        let digest_file = archive.with_extension("digest");
        let current = std::fs::read_to_string(&digest_file).unwrap_or_default();
        if current.trim() == sum && archive.exists() {
            progress(&format!("{}: up to date", spec.name));
            // Best effort: what cannot be removed now is left for the next cleanup.
            let _ = std::fs::remove_dir_all(&work);
            out.push(Built {
                name: spec.name.clone(),
                archive,
                rebuilt: false,
            });
            continue;
        }
        progress(&format!("{}: building", spec.name));
        commit(spec, dir, &work)?;
        let tmp = archive.with_extension("tmp");
        // Best effort: what cannot be removed now is left for the next cleanup.
        let _ = std::fs::remove_file(&tmp);
        run(
            buildah(dir)
                .arg("push")
                .arg("--quiet")
                .arg(&spec.name)
                .arg(format!("oci-archive:{}:{}", tmp.display(), spec.name)),
            "buildah push",
        )?;
        std::fs::rename(&tmp, &archive).map_err(|e| Error::io("renaming the archive", e))?;
        // Best effort: a leftover image only takes space until the next build.
        let _ = run(
            buildah(dir).arg("rmi").arg("--force").arg(&spec.name),
            "buildah rmi",
        );
        let mut f = std::fs::File::create(&digest_file)
            .map_err(|e| Error::io(format!("writing {}", digest_file.display()), e))?;
        writeln!(f, "{sum}").map_err(|e| Error::io("writing the digest", e))?;
        // Best effort: what cannot be removed now is left for the next cleanup.
        let _ = std::fs::remove_dir_all(&work);
        out.push(Built {
            name: spec.name.clone(),
            archive,
            rebuilt: true,
        });
    }
    drop(lock);
    Ok(out)
}

fn commit(spec: &ImageSpec, dir: &Path, work: &Path) -> Result<(), Error> {
    if let Some(cf) = &spec.containerfile {
        run(
            buildah(dir)
                .arg("build")
                .arg("--quiet")
                .arg("--pull=never")
                .arg("--network=none")
                .arg("-f")
                .arg(cf)
                .arg("-t")
                .arg(&spec.name)
                .arg(work),
            "buildah build",
        )?;
        return Ok(());
    }
    let ctr = run(
        buildah(dir).arg("from").arg("scratch"),
        "buildah from scratch",
    )?;
    let ctr = ctr.trim().to_string();
    let result = (|| {
        run(
            buildah(dir)
                .arg("copy")
                .arg("--quiet")
                .arg(&ctr)
                .arg(work.join("rootfs"))
                .arg("/"),
            "buildah copy",
        )?;
        let mut cfg = buildah(dir);
        cfg.arg("config");
        if !spec.entrypoint.is_empty() {
            cfg.arg("--entrypoint")
                .arg(serde_json::to_string(&spec.entrypoint).unwrap_or_default());
        }
        if !spec.cmd.is_empty() {
            cfg.arg("--cmd")
                .arg(serde_json::to_string(&spec.cmd).unwrap_or_default());
        }
        for (k, v) in &spec.env {
            cfg.arg("--env").arg(format!("{k}={v}"));
        }
        if let Some(u) = &spec.user {
            cfg.arg("--user").arg(u);
        }
        cfg.arg(&ctr);
        run(&mut cfg, "buildah config")?;
        run(
            buildah(dir)
                .arg("commit")
                .arg("--quiet")
                .arg(&ctr)
                .arg(&spec.name),
            "buildah commit",
        )
    })();
    // Best effort: a leftover working container only takes space until the next build.
    let _ = run(buildah(dir).arg("rm").arg(&ctr), "buildah rm");
    result.map(|_| ())
}

/// Compile the pause container's program from the Kubernetes source tree
/// (`build/pause/linux/pause.c`) into `out`, statically, when it is missing.
pub fn build_pause(source_tree: &Path, out: &Path) -> Result<PathBuf, Error> {
    if out.exists() {
        return Ok(out.to_path_buf());
    }
    let src = source_tree.join("build/pause/linux/pause.c");
    if let Some(d) = out.parent() {
        std::fs::create_dir_all(d).map_err(|e| Error::io("creating the pause directory", e))?;
    }
    // A name of this call's own: tests and `up` side by side may compile it at once, and the
    // rename makes whichever finishes last the one in place (each is the same program).
    static CALLS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let call = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = out.with_extension(format!("tmp.{}.{call}", std::process::id()));
    run(
        Command::new("gcc")
            .args(["-Os", "-static", "-Wall", "-DVERSION=v3.2-nestplane", "-o"])
            .arg(&tmp)
            .arg(&src),
        "gcc (pause)",
    )?;
    std::fs::rename(&tmp, out).map_err(|e| Error::io("renaming pause", e))?;
    Ok(out.to_path_buf())
}

/// Applets of a busybox binary (`busybox --list`).
pub fn busybox_applets(busybox: &Path) -> Result<Vec<String>, Error> {
    let out = run(Command::new(busybox).arg("--list"), "busybox --list")?;
    Ok(out
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .map(String::from)
        .collect())
}

/// Where built images are kept (`<cache>/images`).
pub fn default_dir() -> PathBuf {
    nestplane_runtime::binaries::cache_dir().join("images")
}

/// The Kubernetes source tree the install script unpacked (pause's source is in it).
pub fn default_source_tree() -> PathBuf {
    nestplane_runtime::binaries::cache_dir().join("kubernetes/build/src")
}

/// Where the install script puts the end-to-end suite's servers of `version` (`v1.20.2`).
pub fn e2e_dir(version: &str) -> PathBuf {
    nestplane_runtime::binaries::cache_dir()
        .join("kubernetes")
        .join(version)
        .join("e2e")
}

fn e2e_file(name: &str, version: &str) -> Result<PathBuf, Error> {
    let p = e2e_dir(version).join(name);
    if p.exists() {
        Ok(p)
    } else {
        Err(Error::Command {
            what: format!("finding {name}"),
            output: format!("{} is missing; {}", p.display(), crate::INSTALL_HINT),
        })
    }
}

/// Find every input on this machine: the Kubernetes binaries of `opts.version`, Debian's etcd
/// and busybox, pause compiled from `source_tree`, and (for the operator image) `nestplane`.
pub fn local_inputs(
    opts: &Options,
    dir: &Path,
    source_tree: &Path,
    nestplane: Option<PathBuf>,
    containerfile: Option<PathBuf>,
) -> Result<Inputs, Error> {
    use nestplane_runtime::binaries;
    let mut kubernetes = BTreeMap::new();
    for name in [
        "kube-apiserver",
        "kube-controller-manager",
        "kube-scheduler",
        "kube-proxy",
    ] {
        kubernetes.insert(name.to_string(), binaries::kubernetes(name, &opts.version)?);
    }
    let busybox = PathBuf::from("/bin/busybox");
    if !busybox.exists() {
        return Err(Error::Command {
            what: "finding busybox".into(),
            output: format!("/bin/busybox is missing; {}", crate::INSTALL_HINT),
        });
    }
    Ok(Inputs {
        kubernetes,
        etcd: binaries::etcd("etcd")?,
        etcdctl: binaries::etcd("etcdctl")?,
        pause: build_pause(source_tree, &dir.join("bin/pause"))?,
        nestplane,
        containerfile,
        busybox_applets: busybox_applets(&busybox)?,
        busybox,
        e2e: {
            let mut names = vec![
                "agnhost",
                "sample-apiserver",
                "localhost.crt",
                "localhost.key",
            ];
            if opts.suite {
                names.extend(["nonewprivs", "kitten", "nautilus"]);
            }
            names
                .into_iter()
                .map(|n| Ok((n.to_string(), e2e_file(n, &opts.version)?)))
                .collect::<Result<_, Error>>()?
        },
        tools: REAL_TOOLS
            .iter()
            .map(|(name, _)| {
                let p = Path::new("/usr/bin").join(name);
                if p.exists() {
                    Ok((name.to_string(), p))
                } else {
                    Err(Error::Command {
                        what: format!("finding {name}"),
                        output: format!("{} is missing; {}", p.display(), crate::INSTALL_HINT),
                    })
                }
            })
            .collect::<Result<_, Error>>()?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn inputs() -> Inputs {
        let mut k = BTreeMap::new();
        for n in ["kube-apiserver", "kube-proxy"] {
            k.insert(n.to_string(), PathBuf::from(format!("/bin/{n}")));
        }
        Inputs {
            kubernetes: k,
            etcd: "/usr/bin/etcd".into(),
            etcdctl: "/usr/bin/etcdctl".into(),
            pause: "/p/pause".into(),
            nestplane: Some("/t/nestplane".into()),
            containerfile: Some("/src/Containerfile".into()),
            busybox: "/bin/busybox".into(),
            busybox_applets: vec!["sh".into(), "busybox".into(), "wget".into()],
            e2e: BTreeMap::from([("agnhost".into(), "/k/agnhost".into())]),
            tools: BTreeMap::new(),
        }
    }

    #[test]
    fn images_carry_the_names_a_real_cluster_pulls() {
        let opts = Options {
            registry: "registry.k8s.io/".into(),
            version: "v1.20.2".into(),
            etcd_tag: "3.4.13-0".into(),
            suite: false,
        };
        let names: Vec<String> = catalog(&opts, &inputs())
            .into_iter()
            .map(|s| s.name)
            .collect();
        assert_eq!(
            names,
            [
                "registry.k8s.io/pause:3.2",
                "registry.k8s.io/kube-apiserver:v1.20.2",
                "registry.k8s.io/kube-proxy:v1.20.2",
                "registry.k8s.io/etcd:3.4.13-0",
                SHELL_IMAGE,
                AGNHOST_IMAGE,
                OPERATOR_IMAGE,
            ]
        );
        // The suite's test server runs `pause` unless a pod gives it arguments, as upstream's.
        let agnhost = catalog(&opts, &inputs())
            .into_iter()
            .find(|s| s.name == AGNHOST_IMAGE)
            .expect("the agnhost image");
        assert_eq!(agnhost.entrypoint, ["/agnhost"]);
        assert_eq!(agnhost.cmd, ["pause"]);
    }

    #[test]
    fn the_shell_image_links_every_applet_but_busybox_itself() {
        let opts = Options {
            registry: "example.test".into(),
            version: "v1.20.2".into(),
            etcd_tag: "3.4.13-0".into(),
            suite: false,
        };
        let shell = catalog(&opts, &inputs())
            .into_iter()
            .find(|s| s.name == SHELL_IMAGE)
            .expect("shell image");
        let links: Vec<&str> = shell
            .entries
            .iter()
            .filter_map(|e| match e {
                Entry::Symlink { link, .. } => Some(link.as_str()),
                _ => None,
            })
            .collect();
        assert_eq!(links, ["/bin/sh", "/bin/wget"]);
    }

    fn links(spec: &ImageSpec) -> Vec<(&str, &str)> {
        spec.entries
            .iter()
            .filter_map(|e| match e {
                Entry::Symlink { link, target } => Some((link.as_str(), target.as_str())),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn the_suites_images_have_its_names_and_real_tools_before_busybox() {
        let opts = Options {
            registry: "registry.k8s.io".into(),
            version: "v1.20.2".into(),
            etcd_tag: "3.4.13-0".into(),
            suite: true,
        };
        let mut inp = inputs();
        inp.busybox_applets = ["sh", "nc", "wget", "busybox"].map(String::from).to_vec();
        for (n, _) in REAL_TOOLS {
            inp.tools.insert(n.into(), format!("/usr/bin/{n}").into());
        }
        for n in ["nonewprivs", "kitten", "nautilus"] {
            inp.e2e.insert(n.into(), format!("/k/{n}").into());
        }
        let specs = catalog(&opts, &inp);
        let names: Vec<&str> = specs.iter().map(|s| s.name.as_str()).collect();
        for want in SUITE_IMAGES {
            assert!(names.contains(&want), "{want} missing from {names:?}");
        }
        let by = |n: &str| specs.iter().find(|s| s.name == n).expect(n);
        // Where the suite runs `nc -z` or `dig`, the shell is bash and finds the real tools:
        // busybox's `sh` and `nc` are not linked.
        for name in [AGNHOST_IMAGE, SUITE_IMAGES[8]] {
            let l = links(by(name));
            assert!(l.contains(&("/bin/sh", "bash")), "{name}: {l:?}");
            assert!(l.contains(&("/bin/wget", "/bin/busybox")), "{name}: {l:?}");
            assert!(
                !l.iter().any(|(link, _)| *link == "/bin/nc"),
                "{name}: {l:?}"
            );
            for (tool, dst) in REAL_TOOLS {
                assert!(
                    by(name).entries.iter().any(|e| matches!(e,
                        Entry::File { dst: d, libs: true, .. } if d == dst)),
                    "{name} lacks {tool}"
                );
            }
        }
        // nautilus serves its page with agnhost's test-webserver, as upstream's.
        let nautilus = by(SUITE_IMAGES[7]);
        assert_eq!(nautilus.cmd, ["test-webserver"]);
        assert!(nautilus.entries.iter().any(
            |e| matches!(e, Entry::File { src, dst, .. } if dst == "/data.json" && src == Path::new("/k/nautilus/data.json"))
        ));
        // nnp is set-user-ID root; nonroot runs as 1234 unless told otherwise.
        assert!(by(SUITE_IMAGES[5]).entries.contains(&Entry::Mode {
            path: "/usr/local/bin/nnp".into(),
            mode: 0o4755
        }));
        assert_eq!(by(SUITE_IMAGES[9]).user.as_deref(), Some("1234"));
        // The web servers answer on port 80 from the upstream image's document root.
        let httpd = by(SUITE_IMAGES[1]);
        assert!(httpd.cmd.windows(2).any(|w| w == ["-p", "80"]));
        assert!(httpd.entries.iter().any(|e| matches!(e,
            Entry::Text { dst, .. } if dst == "/usr/local/apache2/htdocs/index.html")));
        // Without `suite`, none of them is built.
        let plain = catalog(
            &Options {
                suite: false,
                ..opts
            },
            &inp,
        );
        assert!(
            !plain
                .iter()
                .any(|s| SUITE_IMAGES.contains(&s.name.as_str()))
        );
    }

    #[test]
    fn ldd_output_gives_library_paths() {
        let text = "\tlinux-vdso.so.1 (0x00007f)\n\tlibc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x7f)\n\t/lib64/ld-linux-x86-64.so.2 (0x7f)\n";
        assert_eq!(
            parse_ldd(text),
            [
                PathBuf::from("/lib/x86_64-linux-gnu/libc.so.6"),
                PathBuf::from("/lib64/ld-linux-x86-64.so.2")
            ]
        );
        assert!(parse_ldd("\tnot a dynamic executable\n").is_empty());
    }

    #[test]
    fn archive_names_are_file_names() {
        assert_eq!(
            archive_path(Path::new("/c"), "registry.k8s.io/etcd:3.4.13-0"),
            PathBuf::from("/c/registry.k8s.io_etcd_3.4.13-0.oci.tar")
        );
    }

    /// Test processes and `up` start together on a fresh machine, and each compiles pause
    /// when it is missing: every one of them must end with the program in place.
    #[test]
    fn pause_compiled_by_several_at_once_is_in_place_for_each() {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let src = dir.path().join("src");
        std::fs::create_dir_all(src.join("build/pause/linux")).expect("a source tree");
        std::fs::write(
            src.join("build/pause/linux/pause.c"),
            "int main(void) { return 0; }\n",
        )
        .expect("pause.c");
        let out = dir.path().join("bin/pause");
        let results: Vec<_> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..4)
                .map(|_| s.spawn(|| build_pause(&src, &out)))
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("a compiling thread"))
                .collect()
        });
        for r in results {
            assert_eq!(r.expect("pause compiled"), out);
        }
        assert!(Command::new(&out).status().expect("pause runs").success());
    }
}
