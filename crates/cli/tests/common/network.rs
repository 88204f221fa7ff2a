//! The servers of the end-to-end suite a hosted cluster's API server must reach in its own
//! cluster (agnhost's admission and conversion webhooks, the sample API server), and what a
//! user checks of them: shared by both runtimes' tests.

use std::path::Path;
use std::time::Duration;

use super::*;
use nestplane_nodes::images::{AGNHOST_IMAGE, SAMPLE_APISERVER_IMAGE};

/// The servers' namespace.
pub const NS: &str = "net-test";
/// The sample API server's etcd.
pub const ETCD_IMAGE: &str = "registry.k8s.io/etcd:3.4.13-0";
/// The images a node needs for [`servers`].
pub const IMAGES: [&str; 3] = [AGNHOST_IMAGE, SAMPLE_APISERVER_IMAGE, ETCD_IMAGE];

/// A CA and one serving certificate for the test's Services.
pub fn serving() -> (String, nestplane_pki::CertKey) {
    let now = time::OffsetDateTime::now_utc();
    let ca = nestplane_pki::generate_ca("net-test-ca", now).unwrap();
    let leaf = nestplane_pki::issue(
        &ca,
        &nestplane_pki::LeafSpec {
            common_name: "net-test".into(),
            organizations: vec![],
            dns_names: ["webhook", "conversion", "sample-api"]
                .iter()
                .map(|s| format!("{s}.{NS}.svc"))
                .collect(),
            ips: vec![],
            usage: nestplane_pki::Usage::Server,
        },
        now,
    )
    .unwrap();
    (ca.cert_pem, leaf)
}

pub fn b64(s: &str) -> String {
    nestplane_pki::base64(s.as_bytes())
}

/// The servers: agnhost's admission and conversion webhooks, and the sample API server with
/// its etcd, each behind a Service, with what the sample API server needs to delegate
/// authentication and authorization.
pub fn servers(leaf: &nestplane_pki::CertKey) -> String {
    format!(
        r#"apiVersion: v1
kind: Namespace
metadata: {{name: {NS}}}
---
apiVersion: v1
kind: Secret
metadata: {{name: serving, namespace: {NS}}}
type: kubernetes.io/tls
data: {{tls.crt: {crt}, tls.key: {key}}}
---
apiVersion: v1
kind: Pod
metadata: {{name: webhook, namespace: {NS}, labels: {{app: webhook}}}}
spec:
  containers:
  - name: webhook
    image: {AGNHOST_IMAGE}
    args: [webhook, --tls-cert-file=/certs/tls.crt, --tls-private-key-file=/certs/tls.key, --port=8443]
    volumeMounts: [{{name: certs, mountPath: /certs, readOnly: true}}]
  volumes: [{{name: certs, secret: {{secretName: serving}}}}]
---
apiVersion: v1
kind: Service
metadata: {{name: webhook, namespace: {NS}}}
spec:
  selector: {{app: webhook}}
  ports: [{{port: 443, targetPort: 8443}}]
---
apiVersion: v1
kind: Pod
metadata: {{name: conversion, namespace: {NS}, labels: {{app: conversion}}}}
spec:
  containers:
  - name: conversion
    image: {AGNHOST_IMAGE}
    args: [crd-conversion-webhook, --tls-cert-file=/certs/tls.crt, --tls-private-key-file=/certs/tls.key, --port=9443]
    volumeMounts: [{{name: certs, mountPath: /certs, readOnly: true}}]
  volumes: [{{name: certs, secret: {{secretName: serving}}}}]
---
apiVersion: v1
kind: Service
metadata: {{name: conversion, namespace: {NS}}}
spec:
  selector: {{app: conversion}}
  ports: [{{port: 443, targetPort: 9443}}]
---
apiVersion: v1
kind: ServiceAccount
metadata: {{name: sample-api, namespace: {NS}}}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: RoleBinding
metadata: {{name: sample-api-auth-reader, namespace: kube-system}}
roleRef: {{apiGroup: rbac.authorization.k8s.io, kind: Role, name: extension-apiserver-authentication-reader}}
subjects: [{{kind: ServiceAccount, name: sample-api, namespace: {NS}}}]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {{name: sample-api-auth-delegator}}
roleRef: {{apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: "system:auth-delegator"}}
subjects: [{{kind: ServiceAccount, name: sample-api, namespace: {NS}}}]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {{name: sample-api-reader}}
rules:
- {{apiGroups: [""], resources: [namespaces], verbs: [get, list, watch]}}
- {{apiGroups: [admissionregistration.k8s.io], resources: ["*"], verbs: [get, list, watch]}}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {{name: sample-api-reader}}
roleRef: {{apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: sample-api-reader}}
subjects: [{{kind: ServiceAccount, name: sample-api, namespace: {NS}}}]
---
apiVersion: v1
kind: Pod
metadata: {{name: sample-api, namespace: {NS}, labels: {{app: sample-api}}}}
spec:
  serviceAccountName: sample-api
  containers:
  - name: sample-apiserver
    image: {SAMPLE_APISERVER_IMAGE}
    args: [--etcd-servers=http://127.0.0.1:2379, --tls-cert-file=/certs/tls.crt, --tls-private-key-file=/certs/tls.key, --secure-port=8443, --audit-log-path=-, --audit-log-maxage=0, --audit-log-maxbackup=0]
    volumeMounts: [{{name: certs, mountPath: /certs, readOnly: true}}]
  - name: etcd
    image: {ETCD_IMAGE}
    command: [/usr/local/bin/etcd, --data-dir=/tmp/etcd, --listen-client-urls=http://127.0.0.1:2379, --advertise-client-urls=http://127.0.0.1:2379]
  volumes: [{{name: certs, secret: {{secretName: serving}}}}]
---
apiVersion: v1
kind: Service
metadata: {{name: sample-api, namespace: {NS}}}
spec:
  selector: {{app: sample-api}}
  ports: [{{port: 443, targetPort: 8443}}]
"#,
        crt = b64(&leaf.cert_pem),
        key = b64(&leaf.key_pem),
    )
}

/// What points the API server at the servers: a validating webhook that denies ConfigMaps in
/// namespaces labelled `webhook-test: deny`, a CRD whose versions a webhook converts, and the
/// sample API's `APIService`; all through Service `service` of namespace `ns`, trusting `ca`.
pub fn clients(ca: &str, ns: &str, service: Option<&str>) -> String {
    let svc = |own: &str| service.unwrap_or(own).to_string();
    format!(
        r#"apiVersion: admissionregistration.k8s.io/v1
kind: ValidatingWebhookConfiguration
metadata: {{name: deny-configmaps}}
webhooks:
- name: deny.net-test.example.com
  rules: [{{operations: [CREATE], apiGroups: [""], apiVersions: [v1], resources: [configmaps]}}]
  namespaceSelector: {{matchLabels: {{webhook-test: deny}}}}
  clientConfig:
    service: {{namespace: {ns}, name: {webhook}, path: /always-deny, port: 443}}
    caBundle: {ca}
  sideEffects: None
  admissionReviewVersions: [v1, v1beta1]
  failurePolicy: Fail
  timeoutSeconds: 10
---
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata: {{name: widgets.stable.example.com}}
spec:
  group: stable.example.com
  scope: Namespaced
  names: {{plural: widgets, singular: widget, kind: Widget, listKind: WidgetList}}
  versions:
  - name: v1
    served: true
    storage: true
    schema: {{openAPIV3Schema: {{type: object, properties: {{hostPort: {{type: string}}}}}}}}
  - name: v2
    served: true
    storage: false
    schema: {{openAPIV3Schema: {{type: object, properties: {{host: {{type: string}}, port: {{type: string}}}}}}}}
  conversion:
    strategy: Webhook
    webhook:
      conversionReviewVersions: [v1, v1beta1]
      clientConfig:
        service: {{namespace: {ns}, name: {conversion}, path: /crdconvert, port: 443}}
        caBundle: {ca}
---
apiVersion: apiregistration.k8s.io/v1
kind: APIService
metadata: {{name: v1alpha1.wardle.example.com}}
spec:
  group: wardle.example.com
  version: v1alpha1
  groupPriorityMinimum: 2000
  versionPriority: 200
  service: {{namespace: {ns}, name: {sample}, port: 443}}
  caBundle: {ca}
---
apiVersion: v1
kind: Namespace
metadata: {{name: denied, labels: {{webhook-test: deny}}}}
"#,
        ca = b64(ca),
        webhook = svc("webhook"),
        conversion = svc("conversion"),
        sample = svc("sample-api"),
    )
}

pub fn stderr_of(kc: &Path, args: &[&str]) -> Option<String> {
    let out = kubectl(kc, args);
    (!out.status.success()).then(|| String::from_utf8_lossy(&out.stderr).into_owned())
}

/// Serve [`servers`] in the cluster of `kc` and point its API server at them ([`clients`]);
/// then what users check: the proxy subresources of a Service and a pod answer over https,
/// the admission webhook (called at a Service address) denies, the conversion webhook
/// converts, the aggregated API is `Available` and answers. Returns the CA the clients trust.
pub fn serve_and_reach(kc: &Path) -> String {
    let (ca, leaf) = serving();
    kubectl_apply(kc, &servers(&leaf));
    kubectl_ok(
        kc,
        &[
            "wait",
            "-n",
            NS,
            "--for=condition=Ready",
            "pod/webhook",
            "pod/conversion",
            "pod/sample-api",
            "--timeout=180s",
        ],
    );
    kubectl_apply(kc, &clients(&ca, NS, None));

    // The proxy subresources, over https, to a Service and to a pod.
    for path in [
        format!("/api/v1/namespaces/{NS}/services/https:webhook:443/proxy/readyz"),
        format!("/api/v1/namespaces/{NS}/pods/https:webhook:8443/proxy/readyz"),
    ] {
        eventually(&format!("{path} answers"), Duration::from_secs(60), || {
            let out = kubectl(kc, &["get", "--raw", &path]);
            (out.status.success() && out.stdout == b"ok").then_some(())
        });
    }

    // The admission webhook, called at a Service address, denies.
    let denied = eventually(
        "the webhook denies a ConfigMap",
        Duration::from_secs(60),
        || {
            stderr_of(kc, &["create", "configmap", "c1", "-n", "denied"])
                .filter(|e| e.contains("this webhook denies all requests"))
        },
    );
    assert!(denied.contains("deny.net-test.example.com"), "{denied}");
    kubectl_ok(kc, &["create", "configmap", "c1", "-n", NS]);

    // The conversion webhook converts: stored as v1, read as v2.
    super::wait_established(kc, "widgets.stable.example.com");
    eventually("a v1 Widget is created", Duration::from_secs(30), || {
        kubectl_stdin(
            kc,
            &["apply", "-f", "-"],
            Some(&format!("apiVersion: stable.example.com/v1\nkind: Widget\nmetadata: {{name: w1, namespace: {NS}}}\nhostPort: \"localhost:8080\"\n")),
        )
        .status
        .success()
        .then_some(())
    });
    let v2 = eventually("the Widget read as v2", Duration::from_secs(60), || {
        let out = kubectl(
            kc,
            &[
                "get",
                "widgets.v2.stable.example.com",
                "w1",
                "-n",
                NS,
                "-o",
                "jsonpath={.apiVersion} {.host} {.port}",
            ],
        );
        out.status
            .success()
            .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
    });
    assert_eq!(v2, "stable.example.com/v2 localhost 8080");

    // The aggregated API is Available and answers.
    eventually(
        "the sample APIService Available",
        Duration::from_secs(120),
        || {
            (condition(
                kc,
                &["apiservice", "v1alpha1.wardle.example.com"],
                "Available",
            ) == "True")
                .then_some(())
        },
    );
    eventually("a Flunder is created", Duration::from_secs(60), || {
        kubectl_stdin(
            kc,
            &["apply", "-f", "-"],
            Some(&format!("apiVersion: wardle.example.com/v1alpha1\nkind: Flunder\nmetadata: {{name: f1, namespace: {NS}}}\nspec: {{}}\n")),
        )
        .status
        .success()
        .then_some(())
    });
    let flunder = kubectl_ok(
        kc,
        &[
            "get",
            "flunders.wardle.example.com",
            "f1",
            "-n",
            NS,
            "-o",
            "jsonpath={.kind}/{.metadata.name}",
        ],
    );
    assert_eq!(flunder, "Flunder/f1");
    ca
}
