//! Who may call the REST API: a caller without a token, with a bad or
//! revoked one, or with a read-only one where a change is asked, is
//! refused and changes nothing; the admin token `shoal up` wrote works.

mod common;

use common::{curl, Cluster};

fn bearer(token: &str) -> String {
    format!("Authorization: Bearer {token}")
}

#[test]
fn the_api_needs_a_token_of_the_right_role() {
    common::require("curl");
    let c = Cluster::start(3);
    c.create_volume("v", "64M", "raid1 ftt=1");
    let api = c.api(2);
    let admin = c.token();
    let create = [
        "-X",
        "POST",
        "-H",
        "content-type: application/json",
        "-d",
        r#"{"name":"x","size":4096,"policy":"ftt=0"}"#,
    ];

    // No token: nothing but /livez.
    for (path, extra) in [
        ("/v1/status", &[][..]),
        ("/v1/volumes", &[][..]),
        ("/metrics", &[][..]),
        ("/v1/tokens", &[][..]),
        ("/v1/volumes", &create[..]),
        ("/v1/volumes/v?force=true", &["-X", "DELETE"][..]),
        ("/v1/scrub", &["-X", "POST"][..]),
        ("/v1/cluster/settings", &[][..]),
    ] {
        let (code, body) = curl(&format!("{api}{path}"), extra);
        assert_eq!(code, 401, "{path} {extra:?}: {body}");
        assert!(body.contains("needs a token"), "{body}");
    }
    let (code, body) = curl(&format!("{api}/livez"), &[]);
    assert_eq!(code, 200, "{body}");
    assert!(body.contains("cluster_id"), "{body}");
    assert!(!body.contains("\"v\""), "livez names no volume: {body}");

    // A forged token: refused.
    let forged = format!("shoal-{}-{}", "0".repeat(16), "1".repeat(64));
    for t in [forged.as_str(), "shoal-garbage", "Basic abc"] {
        let (code, _) = curl(&format!("{api}/v1/status"), &["-H", &bearer(t)]);
        assert_eq!(code, 401, "{t}");
    }

    // A read-only token reads and changes nothing.
    let ro = c.shoal(&["token", "create", "--role", "read-only", "--note", "test"]);
    let ro = ro.trim();
    let (code, body) = curl(&format!("{api}/v1/volumes"), &["-H", &bearer(ro)]);
    assert_eq!(code, 200, "{body}");
    assert!(body.contains("\"v\""), "{body}");
    let (code, body) = curl(&format!("{api}/metrics"), &["-H", &bearer(ro)]);
    assert_eq!(code, 200, "{body}");
    let ro_header = bearer(ro);
    let mut args = create.to_vec();
    args.extend(["-H", &ro_header]);
    for (path, extra) in [
        ("/v1/volumes", args.clone()),
        (
            "/v1/volumes/v?force=true",
            vec!["-X", "DELETE", "-H", &ro_header],
        ),
        (
            "/v1/tokens",
            vec![
                "-X",
                "POST",
                "-H",
                "content-type: application/json",
                "-d",
                r#"{"role":"Admin"}"#,
                "-H",
                &ro_header,
            ],
        ),
    ] {
        let (code, body) = curl(&format!("{api}{path}"), &extra);
        assert_eq!(code, 403, "{path}: {body}");
    }
    let err = c
        .cmd()
        .env("SHOAL_TOKEN", ro)
        .args(["volume", "delete", "v", "--force"])
        .output()
        .expect("shoal");
    assert!(!err.status.success());
    assert!(String::from_utf8_lossy(&err.stderr).contains("read-only"));
    read_only_reads_the_settings_and_cannot_set_them(&c, ro);

    // Revoked: refused everywhere (the revocation is applied on every node).
    let id = ro.split('-').nth(1).expect("id");
    c.shoal(&["token", "revoke", id]);
    common::wait_for(
        "the revocation applied on node 3",
        std::time::Duration::from_secs(10),
        || match curl(&format!("{}/v1/volumes", c.api(3)), &["-H", &bearer(ro)]).0 {
            401 => Ok(()),
            code => Err(format!("HTTP {code}")),
        },
    );

    // Nothing changed; the admin token works.
    let list = c.json(&["volume", "list"]);
    assert_eq!(list.as_array().map(Vec::len), Some(1), "{list}");
    let admin_header = bearer(&admin);
    let mut a = create.to_vec();
    a.extend(["-H", &admin_header]);
    let (code, body) = curl(&format!("{api}/v1/volumes"), &a);
    assert_eq!(code, 200, "{body}");
    let tokens = c.shoal(&["token", "list"]);
    assert!(tokens.contains("admin"), "{tokens}");
    assert!(!tokens.contains(&admin[23..]), "secrets are never listed");
}

/// A read-only token reads the cluster's settings and cannot change them,
/// over REST or with `shoal cluster set`.
fn read_only_reads_the_settings_and_cannot_set_them(c: &Cluster, ro: &str) {
    let url = format!("{}/v1/cluster/settings", c.api(1));
    let (code, body) = curl(&url, &["-H", &bearer(ro)]);
    assert_eq!(code, 200, "{body}");
    assert!(body.contains(r#""repair_delay_s":3600"#), "{body}");
    let set = [
        "-X",
        "POST",
        "-H",
        "content-type: application/json",
        "-d",
        r#"{"repair_delay_s":30}"#,
    ];
    let ro_header = bearer(ro);
    let mut args = set.to_vec();
    args.extend(["-H", &ro_header]);
    let (code, body) = curl(&url, &args);
    assert_eq!(code, 403, "{body}");
    let limit = [
        "-X",
        "POST",
        "-H",
        "content-type: application/json",
        "-d",
        r#"{"resync_mib_per_s":5}"#,
        "-H",
        &ro_header,
    ];
    let (code, body) = curl(&url, &limit);
    assert_eq!(code, 403, "{body}");
    let out = c
        .cmd()
        .env("SHOAL_TOKEN", ro)
        .args(["cluster", "set", "repair-delay", "30s"])
        .output()
        .expect("shoal");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("read-only"), "{err}");
    let settings = c
        .cmd()
        .env("SHOAL_TOKEN", ro)
        .args(["cluster", "settings"])
        .output();
    let settings = String::from_utf8_lossy(&settings.expect("shoal").stdout).into_owned();
    assert_eq!(
        settings.trim(),
        "repair-delay: 1h\nresync-mib-per-s: 0 (adaptive)",
        "unchanged"
    );
}
