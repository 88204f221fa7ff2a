.PHONY: up down test crds release-manifests bench soak conformance fmt

# A local management plane, the operator and a tenant control plane (foreground; Ctrl-C stops).
up:
	scripts/up.sh $(ARGS)

# Remove the tenant and the management plane state created by `make up`.
down:
	cargo run --release --quiet -p nestplane-cli -- down $(ARGS)

# Everything CI runs: install deps, fmt, clippy, all tests against real binaries.
test:
	scripts/test.sh

# Regenerate the checked-in CRDs (each provider's where its kustomize tree reads them) and
# the clusterctl install manifests.
crds:
	cargo run --quiet -p nestplane-cli -- crds --provider control-plane > config/crd/nestplane.yaml.new
	cargo run --quiet -p nestplane-cli -- crds --provider bootstrap > config/bootstrap/crds.yaml.new
	mv config/crd/nestplane.yaml.new config/crd/nestplane.yaml
	mv config/bootstrap/crds.yaml.new config/bootstrap/crds.yaml
	kubectl kustomize config/default > control-plane-components.yaml
	kubectl kustomize config/bootstrap > bootstrap-components.yaml

# Regenerate the clusterctl install manifests from the kustomize trees under config/: the
# control-plane provider (config/default) and the bootstrap provider (config/bootstrap).
release-manifests: crds

bench:
	scripts/bench.sh

# Kill the operator at random 100 times while 20 tenants are created; all must converge with
# their CAs unchanged (minutes; not part of `make test`). ARGS="TENANTS KILLS" to change.
soak:
	scripts/soak.sh $(ARGS)

# Kubernetes' own [Conformance] specs against a fresh `nestplane up --nodes 2` hosted cluster
# (about an hour on 2 cores; not part of `make test`). ARGS=serial for the [Serial] ones;
# FOCUS=regex for a subset. Prints `N passed, M failed`; reports in target/conformance.
conformance:
	scripts/conformance.sh $(ARGS)

fmt:
	cargo fmt --all
