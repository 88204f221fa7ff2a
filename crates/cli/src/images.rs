//! `nestplane images build`: the images nodes run, built here with buildah.

use std::path::PathBuf;

use anyhow::Context;
use nestplane_nodes::images;

/// `nestplane images …`
#[derive(clap::Subcommand, Debug)]
pub enum ImagesCommand {
    /// Build pause, kube-apiserver, kube-controller-manager, kube-scheduler, kube-proxy, etcd,
    /// the operator (from the Containerfile) and a busybox shell image as OCI archives; only
    /// images whose contents changed are rebuilt. Prints one archive path per line.
    Build(BuildArgs),
}

/// Arguments of `nestplane images build`.
#[derive(clap::Args, Debug)]
pub struct BuildArgs {
    /// Registry the Kubernetes images are named under (the operator's `--image-registry`).
    #[arg(long, default_value = nestplane_render::DEFAULT_IMAGE_REGISTRY)]
    pub registry: String,
    /// Kubernetes version of the images.
    #[arg(long, default_value = nestplane_localplane::DEFAULT_VERSION)]
    pub version: String,
    /// Where the OCI archives go (default: `~/.cache/nestplane/images`).
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// The `nestplane` binary for the operator image (default: this one).
    #[arg(long)]
    pub operator_binary: Option<PathBuf>,
    /// The operator image's Containerfile (default: `Containerfile` in the current directory,
    /// else the one in this binary's source tree).
    #[arg(long)]
    pub containerfile: Option<PathBuf>,
    /// Also the end-to-end suite's other images (busybox 1.29, the httpd and nginx names,
    /// nonewprivs, nonroot, kitten, nautilus, jessie-dnsutils), for `make conformance`.
    #[arg(long)]
    pub suite: bool,
}

/// Run an images command.
pub fn run(cmd: ImagesCommand) -> anyhow::Result<()> {
    match cmd {
        ImagesCommand::Build(args) => {
            for b in build(&args)? {
                println!("{}", b.archive.display());
            }
            Ok(())
        }
    }
}

/// Build the images `args` describe.
pub fn build(args: &BuildArgs) -> anyhow::Result<Vec<images::Built>> {
    let version =
        nestplane_render::KubeVersion::parse(&args.version).map_err(|e| anyhow::anyhow!("{e}"))?;
    let opts = images::Options {
        registry: args.registry.clone(),
        version: args.version.clone(),
        etcd_tag: nestplane_render::etcd_version_for(&version).to_string(),
        suite: args.suite,
    };
    let dir = args.dir.clone().unwrap_or_else(images::default_dir);
    let binary = match &args.operator_binary {
        Some(b) => b.clone(),
        None => std::env::current_exe().context("finding this binary")?,
    };
    let containerfile = args.containerfile.clone().unwrap_or_else(|| {
        let here = PathBuf::from("Containerfile");
        if here.exists() {
            here
        } else {
            PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../Containerfile"))
        }
    });
    let inputs = images::local_inputs(
        &opts,
        &dir,
        &images::default_source_tree(),
        Some(binary),
        Some(containerfile),
    )?;
    let specs = images::catalog(&opts, &inputs);
    let built = images::build(&specs, &dir, &mut |line| eprintln!("images: {line}"))?;
    Ok(built)
}
