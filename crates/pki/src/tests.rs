#![allow(clippy::unwrap_used, clippy::expect_used)]

use super::*;

fn now() -> OffsetDateTime {
    OffsetDateTime::from_unix_timestamp(1_800_000_000).unwrap()
}

fn ca() -> CertKey {
    generate_ca("test-ca", now()).unwrap()
}

fn server_spec() -> LeafSpec {
    LeafSpec {
        common_name: "kube-apiserver".into(),
        dns_names: vec![
            "kubernetes".into(),
            "kubernetes.default.svc".into(),
            "kubernetes".into(),
        ],
        ips: vec!["127.64.1.1".parse().unwrap(), "10.96.0.1".parse().unwrap()],
        usage: Usage::Server,
        ..LeafSpec::default()
    }
}

#[test]
fn ca_is_a_self_signed_ten_year_ca() {
    let ca = ca();
    let info = inspect(&ca.cert_pem).unwrap();
    assert!(info.is_ca);
    assert_eq!(info.subject_cn, "test-ca");
    assert_eq!(info.issuer_cn, "test-ca");
    assert_eq!(info.not_after - now(), CA_VALIDITY);
    assert!(info.not_before < now());
    assert!(verify_signed_by(&ca.cert_pem, &ca.cert_pem).unwrap());
    assert!(key_matches(&ca.cert_pem, &ca.key_pem).unwrap());
}

#[test]
fn leaf_chains_to_its_ca_only() {
    let ca = ca();
    let other = generate_ca("other", now()).unwrap();
    let leaf = issue(&ca, &server_spec(), now()).unwrap();
    assert!(verify_signed_by(&leaf.cert_pem, &ca.cert_pem).unwrap());
    assert!(!verify_signed_by(&leaf.cert_pem, &other.cert_pem).unwrap());
    let info = inspect(&leaf.cert_pem).unwrap();
    assert_eq!(info.issuer_cn, "test-ca");
    assert!(!info.is_ca);
    assert!(!key_matches(&leaf.cert_pem, &ca.key_pem).unwrap());
    assert!(key_matches(&leaf.cert_pem, &leaf.key_pem).unwrap());
}

#[test]
fn server_leaf_has_exactly_the_requested_sans_and_usage() {
    let leaf = issue(&ca(), &server_spec(), now()).unwrap();
    let info = inspect(&leaf.cert_pem).unwrap();
    assert_eq!(
        info.dns_names,
        vec![
            "kubernetes".to_string(),
            "kubernetes.default.svc".to_string()
        ]
    );
    let mut ips = info.ips.clone();
    ips.sort();
    assert_eq!(
        ips,
        vec![
            "10.96.0.1".parse::<IpAddr>().unwrap(),
            "127.64.1.1".parse().unwrap()
        ]
    );
    assert!(info.server_auth && !info.client_auth);
    assert_eq!(info.not_after - now(), LEAF_VALIDITY);
}

#[test]
fn client_leaf_carries_user_and_groups() {
    let spec = LeafSpec {
        common_name: "kubernetes-admin".into(),
        organizations: vec!["system:masters".into()],
        usage: Usage::Client,
        ..LeafSpec::default()
    };
    let info = inspect(&issue(&ca(), &spec, now()).unwrap().cert_pem).unwrap();
    assert_eq!(info.subject_cn, "kubernetes-admin");
    assert_eq!(info.organizations, vec!["system:masters".to_string()]);
    assert!(info.client_auth && !info.server_auth);
    assert!(info.dns_names.is_empty() && info.ips.is_empty());
    let both = LeafSpec {
        usage: Usage::ServerAndClient,
        ..spec
    };
    let info = inspect(&issue(&ca(), &both, now()).unwrap().cert_pem).unwrap();
    assert!(info.client_auth && info.server_auth);
}

#[test]
fn renewal_at_half_life() {
    let leaf = issue(&ca(), &server_spec(), now()).unwrap();
    let info = inspect(&leaf.cert_pem).unwrap();
    let half = info.not_before + (info.not_after - info.not_before) / 2;
    assert!(!needs_renewal(&leaf.cert_pem, now()));
    assert!(!needs_renewal(
        &leaf.cert_pem,
        half - time::Duration::minutes(1)
    ));
    assert!(needs_renewal(
        &leaf.cert_pem,
        half + time::Duration::minutes(1)
    ));
    assert!(needs_renewal(
        &leaf.cert_pem,
        info.not_after + time::Duration::days(1)
    ));
    assert!(needs_renewal("not a certificate", now()));
}

#[test]
fn leaf_never_outlives_its_ca() {
    let old_ca = generate_ca("old", now() - CA_VALIDITY + time::Duration::days(10)).unwrap();
    let leaf = issue(&old_ca, &server_spec(), now()).unwrap();
    let ca_info = inspect(&old_ca.cert_pem).unwrap();
    assert_eq!(
        inspect(&leaf.cert_pem).unwrap().not_after,
        ca_info.not_after
    );
}

#[test]
fn service_account_key_pair() {
    let sa = generate_service_account_key().unwrap();
    assert!(sa.cert_pem.starts_with("-----BEGIN PUBLIC KEY-----"));
    assert!(sa.key_pem.starts_with("-----BEGIN PRIVATE KEY-----"));
    assert_ne!(generate_service_account_key().unwrap(), sa);
}

#[test]
fn kubeconfig_round_trips() {
    let ca = ca();
    let client = issue(
        &ca,
        &LeafSpec {
            common_name: "admin".into(),
            ..LeafSpec::default()
        },
        now(),
    )
    .unwrap();
    let kc = kubeconfig(
        "demo",
        "https://127.64.1.1:6443",
        None,
        &ca.cert_pem,
        "admin",
        &client,
    )
    .unwrap();
    assert_eq!(
        kc,
        kubeconfig(
            "demo",
            "https://127.64.1.1:6443",
            None,
            &ca.cert_pem,
            "admin",
            &client
        )
        .unwrap()
    );
    let v: serde_json::Value = serde_saphyr::from_str(&kc).unwrap();
    assert_eq!(v["current-context"].as_str(), Some("admin@demo"));
    assert_eq!(
        v["clusters"][0]["cluster"]["server"].as_str(),
        Some("https://127.64.1.1:6443")
    );
    let decode = |s: &serde_json::Value| {
        String::from_utf8(
            base64::engine::general_purpose::STANDARD
                .decode(s.as_str().unwrap())
                .unwrap(),
        )
        .unwrap()
    };
    assert_eq!(
        decode(&v["clusters"][0]["cluster"]["certificate-authority-data"]),
        ca.cert_pem
    );
    assert_eq!(
        decode(&v["users"][0]["user"]["client-certificate-data"]),
        client.cert_pem
    );
    assert_eq!(
        decode(&v["users"][0]["user"]["client-key-data"]),
        client.key_pem
    );
    assert_eq!(v["contexts"][0]["context"]["user"].as_str(), Some("admin"));
}

#[test]
fn debug_never_prints_keys() {
    let printed = format!("{:?}", ca());
    assert!(!printed.contains("PRIVATE KEY"), "{printed}");
    assert!(printed.contains("<redacted>"));
}

#[test]
fn a_csr_says_who_it_asks_for_and_garbage_is_refused() {
    let key = KeyPair::generate().unwrap();
    let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
    params
        .distinguished_name
        .push(DnType::CommonName, "system:node:pool-abcde");
    params
        .distinguished_name
        .push(DnType::OrganizationName, "system:nodes");
    let pem = params.serialize_request(&key).unwrap().pem().unwrap();
    let (cn, orgs) = csr_subject(&pem).unwrap();
    assert_eq!(cn, "system:node:pool-abcde");
    assert_eq!(orgs, ["system:nodes"]);
    assert!(
        csr_subject(
            "-----BEGIN CERTIFICATE REQUEST-----\nAAAA\n-----END CERTIFICATE REQUEST-----\n"
        )
        .is_err()
    );
    assert!(csr_subject("not a pem").is_err());
}

#[test]
fn a_csr_names_its_alternative_names() {
    let key = KeyPair::generate().unwrap();
    let mut params = CertificateParams::new(vec!["pool-abcde".to_string()]).unwrap();
    params
        .subject_alt_names
        .push(rcgen::SanType::IpAddress("10.201.3.2".parse().unwrap()));
    params
        .distinguished_name
        .push(DnType::CommonName, "system:node:pool-abcde");
    let pem = params.serialize_request(&key).unwrap().pem().unwrap();
    let info = csr_info(&pem).unwrap();
    assert_eq!(info.common_name, "system:node:pool-abcde");
    assert_eq!(info.dns_names, ["pool-abcde"]);
    assert_eq!(info.ips, ["10.201.3.2".parse::<IpAddr>().unwrap()]);
    assert!(info.other_names.is_empty());
}

/// Made with `openssl req -subj "/O=system:nodes/CN=system:node:good/CN=system:node:evil"`.
const TWO_COMMON_NAMES: &str = "-----BEGIN CERTIFICATE REQUEST-----
MIIBCDCBrwIBADBNMRUwEwYDVQQKDAxzeXN0ZW06bm9kZXMxGTAXBgNVBAMMEHN5
c3RlbTpub2RlOmdvb2QxGTAXBgNVBAMMEHN5c3RlbTpub2RlOmV2aWwwWTATBgcq
hkjOPQIBBggqhkjOPQMBBwNCAARY8VMtGMlqNB1SoXiwIbwjdykTE2Kxm+MgAEg1
iNSrPQMmpTsQOeFOwMdRoeyjU2jAdscTu2r214IEOEhdgU9WoAAwCgYIKoZIzj0E
AwIDSAAwRQIgMFzOzzikSFfa7ifWbS8izvXUkEeZd3jbpuyzbezmE20CIQD/fzOe
97R7+g4Z+V4Dw+XblQMDDRifvJ+zfnGyBcPNBg==
-----END CERTIFICATE REQUEST-----
";

#[test]
fn a_request_with_two_common_names_is_refused() {
    // Go's signer would take the last name, this parser the first: never judged at all.
    let err = csr_info(TWO_COMMON_NAMES).unwrap_err().to_string();
    assert!(err.contains("more than one common name"), "{err}");
}

#[test]
fn a_ca_bundle_signs_with_its_first_certificate_and_trusts_every_one() {
    let (old, new) = (ca(), generate_ca("test-ca-2", now()).unwrap());
    let bundle = format!("{}{}", new.cert_pem, old.cert_pem);
    let certs = certificates(&bundle).unwrap();
    assert_eq!(certs.len(), 2);
    assert_eq!(
        certificate_id(&certs[0]).unwrap(),
        certificate_id(&new.cert_pem).unwrap()
    );
    assert_ne!(
        certificate_id(&certs[1]).unwrap(),
        certificate_id(&certs[0]).unwrap()
    );
    // The bundle with the new CA's key signs as the new CA.
    let signer = CertKey {
        cert_pem: bundle.clone(),
        key_pem: new.key_pem.clone(),
    };
    assert!(key_matches(&signer.cert_pem, &signer.key_pem).unwrap());
    let leaf = issue(&signer, &server_spec(), now()).unwrap();
    assert!(verify_signed_by(&leaf.cert_pem, &new.cert_pem).unwrap());
    assert!(!verify_signed_by(&leaf.cert_pem, &old.cert_pem).unwrap());
    let from_old = issue(&old, &server_spec(), now()).unwrap();
    assert!(verify_signed_by_any(&from_old.cert_pem, &bundle));
    assert!(!verify_signed_by_any(&from_old.cert_pem, &new.cert_pem));
    // The signer alone, whatever follows it (a block only Kubernetes skips among them).
    assert_eq!(first_certificate(&bundle).unwrap(), certs[0]);
    let odd = format!(
        "{}-----BEGIN X509 CRL-----\nAAAA\n-----END X509 CRL-----\n",
        old.cert_pem
    );
    assert!(certificates(&odd).is_err());
    assert_eq!(
        certificate_id(&first_certificate(&odd).unwrap()).unwrap(),
        certificate_id(&old.cert_pem).unwrap()
    );
    // Anything but certificates is refused, never dropped.
    let k = generate_service_account_key().unwrap();
    assert!(certificates(&format!("{}{}", old.cert_pem, k.cert_pem)).is_err());
    assert!(
        certificates("-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n").is_err()
    );
}

#[test]
fn a_certificate_is_taken_out_of_a_bundle_by_its_id_and_nothing_else_is_touched() {
    let now = OffsetDateTime::now_utc();
    let (a, b) = (
        generate_ca("a", now).unwrap(),
        generate_ca("b", now).unwrap(),
    );
    let (ia, ib) = (
        certificate_id(&a.cert_pem).unwrap(),
        certificate_id(&b.cert_pem).unwrap(),
    );
    // A block X.509 parsing refuses, and a block of another kind, among them.
    let junk = "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n";
    let other = "-----BEGIN SOMETHING-----\nAAAA\n-----END SOMETHING-----\n";
    let bundle = format!("{}{junk}{other}{}", a.cert_pem, b.cert_pem);
    assert!(certificates(&bundle).is_err());
    let ids = certificate_ids(&bundle).unwrap();
    assert_eq!(ids.len(), 3);
    assert_eq!(
        (ids[0].as_str(), ids[2].as_str()),
        (ia.as_str(), ib.as_str())
    );
    let left = without_certificate(&bundle, &ia).unwrap().unwrap();
    let left_ids = certificate_ids(&left).unwrap();
    assert_eq!(left_ids.len(), 2);
    assert!(!left_ids.contains(&ia) && left_ids.contains(&ib));
    assert!(left.contains("SOMETHING") && left.contains("AAAA"));
    assert_eq!(without_certificate(&left, &ia).unwrap(), None);
}
