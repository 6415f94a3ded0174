//! The key-file parser against malformed and hostile input, the checks
//! of [`PskKeys::load`] on the file itself, and the TLS-PSK handshake
//! against GnuTLS's own client (`gnutls-cli`, package gnutls-bin): the
//! clients that use these keys (qemu, libnbd) are GnuTLS.

use super::*;
use proptest::prelude::*;
use std::time::Duration;
use tokio::io::AsyncReadExt;

/// 16 bytes: the shortest key accepted.
const KEY16: &str = "00112233445566778899aabbccddeeff";

fn bad(text: &str) -> (usize, LineProblem) {
    PskKeys::parse(text.as_bytes()).expect_err(text)
}

fn hex_of(len: usize) -> String {
    "ab".repeat(len)
}

#[test]
fn a_psktool_file_parses() {
    let text = "alice:6dd7aceb3e2343e7df9bcb4016df82bb424420c258cd2048012f49493592b378\n\
                bob:00112233445566778899AABBCCDDEEFF\n";
    let keys = PskKeys::parse(text.as_bytes()).unwrap();
    assert_eq!(keys.identities(), ["alice", "bob"]);
    assert_eq!(keys.key(b"alice").unwrap().len(), 32);
    assert_eq!(keys.key(b"alice").unwrap()[..2], [0x6d, 0xd7]);
    assert_eq!(keys.key(b"bob").unwrap()[15], 0xff, "upper-case hex");
    assert!(keys.key(b"carol").is_none());
}

#[test]
fn blank_lines_crlf_and_trailing_blanks_are_taken() {
    let text = format!("\n  \r\nalice:{KEY16}\r\n\t\nbob:{KEY16} \t\n\n");
    let keys = PskKeys::parse(text.as_bytes()).unwrap();
    assert_eq!(keys.identities(), ["alice", "bob"]);
    assert_eq!(keys.key(b"bob").unwrap().len(), 16);
}

#[test]
fn an_identity_may_be_hex_as_gnutls_writes_it() {
    // "#HEX" is GnuTLS's form for an identity with odd bytes (a ':').
    let keys = PskKeys::parse(format!("#613a62:{KEY16}\n").as_bytes()).unwrap();
    assert!(keys.key(b"a:b").is_some());
    assert_eq!(keys.identities(), ["a:b"]);
    // The same identity twice, once in each form.
    let text = format!("alice:{KEY16}\n#616c696365:{KEY16}\n");
    assert_eq!(bad(&text), (2, LineProblem::Duplicate("alice".into())));
    // "#" alone is a plain identity.
    assert!(PskKeys::parse(format!("#:{KEY16}").as_bytes())
        .unwrap()
        .key(b"#")
        .is_some());
}

#[test]
fn malformed_lines_are_refused_with_their_number() {
    assert_eq!(bad("alice"), (1, LineProblem::NoColon));
    assert_eq!(
        bad(&format!("alice:{KEY16}\nbob {KEY16}")),
        (2, LineProblem::NoColon)
    );
    assert_eq!(bad(&format!(":{KEY16}")), (1, LineProblem::EmptyIdentity));
    assert_eq!(
        bad(&format!("#zz:{KEY16}")),
        (1, LineProblem::IdentityHex("#zz".into()))
    );
    assert_eq!(
        bad(&format!("#abc:{KEY16}")),
        (1, LineProblem::IdentityHex("#abc".into()))
    );
    assert_eq!(bad("alice:"), (1, LineProblem::EmptyKey));
    assert_eq!(bad("alice:  \t"), (1, LineProblem::EmptyKey));
    assert_eq!(bad(&format!("alice:{KEY16}f")), (1, LineProblem::OddKey));
    assert_eq!(
        bad(&format!("alice:0x{KEY16}")),
        (1, LineProblem::KeyNotHex)
    );
    assert_eq!(
        bad(&format!("alice:{}", "zz".repeat(16))),
        (1, LineProblem::KeyNotHex)
    );
    assert_eq!(
        bad(&format!("alice:{KEY16}  {KEY16}")),
        (1, LineProblem::KeyNotHex)
    );
    // A multi-byte character of two bytes: even, and not hex.
    assert_eq!(bad(&format!("alice:é{KEY16}")), (1, LineProblem::KeyNotHex));
    assert_eq!(
        bad(&format!("alice:{KEY16}\nbob:{KEY16}\nalice:{KEY16}")),
        (3, LineProblem::Duplicate("alice".into()))
    );
}

#[test]
fn identities_with_control_characters_or_edge_spaces_are_refused() {
    for name in [
        "al\u{1}ice",
        "al\tice",
        "al\u{7f}ice",
        "a\0b",
        "\u{1b}[31mred",
    ] {
        assert_eq!(
            bad(&format!("{name}:{KEY16}")),
            (1, LineProblem::IdentityControl),
            "{name:?}"
        );
    }
    // A zero byte cannot reach OpenSSL's C-string identity.
    assert_eq!(
        bad(&format!("#61006263:{KEY16}")),
        (1, LineProblem::IdentityControl)
    );
    assert_eq!(
        bad(&format!(" alice:{KEY16}")),
        (1, LineProblem::IdentitySpace)
    );
    assert_eq!(
        bad(&format!("alice :{KEY16}")),
        (1, LineProblem::IdentitySpace)
    );
    // Inner spaces and other text are an identity like any other.
    let keys = PskKeys::parse(format!("backup host é:{KEY16}").as_bytes()).unwrap();
    assert!(keys.key("backup host é".as_bytes()).is_some());
}

#[test]
fn lengths_of_identities_and_keys_are_bounded() {
    let id = "a".repeat(MAX_IDENTITY_LEN);
    assert!(PskKeys::parse(format!("{id}:{KEY16}").as_bytes()).is_ok());
    assert_eq!(
        bad(&format!("{id}a:{KEY16}")),
        (1, LineProblem::IdentityTooLong)
    );
    let hex_id = "61".repeat(MAX_IDENTITY_LEN + 1);
    assert_eq!(
        bad(&format!("#{hex_id}:{KEY16}")),
        (1, LineProblem::IdentityTooLong)
    );
    assert_eq!(
        bad(&format!("alice:{}", hex_of(MIN_KEY_LEN - 1))),
        (1, LineProblem::KeyTooShort(MIN_KEY_LEN - 1))
    );
    assert_eq!(bad("alice:00"), (1, LineProblem::KeyTooShort(1)));
    assert!(PskKeys::parse(format!("alice:{}", hex_of(MAX_KEY_LEN)).as_bytes()).is_ok());
    assert_eq!(
        bad(&format!("alice:{}", hex_of(MAX_KEY_LEN + 1))),
        (1, LineProblem::KeyTooLong(MAX_KEY_LEN + 1))
    );
    // A huge key is refused by its length before it is decoded.
    assert_eq!(
        bad(&format!("alice:{}", hex_of(100_000))),
        (1, LineProblem::KeyTooLong(100_000))
    );
}

#[test]
fn no_error_or_debug_output_shows_a_key() {
    let secret = "5ec2e75ec2e75ec2e75ec2e75ec2e75e";
    let keys = PskKeys::parse(format!("alice:{secret}").as_bytes()).unwrap();
    let debug = format!("{keys:?}");
    assert!(
        debug.contains("alice") && !debug.contains("5ec2e7"),
        "{debug}"
    );
    let config = PskConfig::new(keys).unwrap();
    assert!(!format!("{config:?}").contains("5ec2e7"));
    for text in [
        format!("alice:{secret}z"),
        format!("alice:{}", &secret[..30]),
        format!("alice:{secret}\nalice:{secret}"),
        format!("al\u{1}ice:{secret}"),
    ] {
        let (line, problem) = bad(&text);
        let shown = format!(
            "{} / {:?}",
            PskError::Line {
                path: "k.psk".into(),
                line,
                problem: problem.clone()
            },
            problem
        );
        assert!(!shown.contains("5ec2e7"), "{shown}");
    }
}

proptest! {
    /// Whatever the bytes, parsing ends with keys or a line error, and a
    /// line error names a line of the text.
    #[test]
    fn arbitrary_bytes_never_panic(text in proptest::collection::vec(any::<u8>(), 0..600)) {
        if let Err((line, _)) = PskKeys::parse(&text) {
            prop_assert!(line >= 1 && line <= text.split(|&b| b == b'\n').count());
        }
    }

    /// Lines near the format (its own characters, shuffled) never panic.
    #[test]
    fn near_misses_never_panic(text in "[a-f0-9:#\r\n \tA-Z]{0,200}") {
        let _ = PskKeys::parse(text.as_bytes());
    }

    /// What psktool would write is read back as written.
    #[test]
    fn well_formed_files_read_back(
        entries in proptest::collection::btree_map(
            "[a-zA-Z0-9_.@-]{1,40}",
            proptest::collection::vec(any::<u8>(), MIN_KEY_LEN..=64),
            1..8,
        ),
        upper in any::<bool>(),
    ) {
        let mut text = String::new();
        for (id, key) in &entries {
            let mut hex: String = key.iter().map(|b| format!("{b:02x}")).collect();
            if upper {
                hex = hex.to_uppercase();
            }
            text.push_str(&format!("{id}:{hex}\n"));
        }
        let keys = PskKeys::parse(text.as_bytes()).unwrap();
        prop_assert_eq!(keys.len(), entries.len());
        for (id, key) in &entries {
            prop_assert_eq!(keys.key(id.as_bytes()), Some(key.as_slice()));
        }
    }
}

// ---- the file ----

fn write(dir: &Path, name: &str, content: &[u8], mode: u32) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, content).unwrap();
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode)).unwrap();
    p
}

#[test]
fn load_reads_a_file_of_its_owner_only() {
    let tmp = tempfile::tempdir().unwrap();
    let line = format!("alice:{KEY16}\n");
    for mode in [0o600, 0o400] {
        let p = write(tmp.path(), "ok.psk", line.as_bytes(), mode);
        assert_eq!(PskKeys::load(&p).unwrap().identities(), ["alice"]);
    }
    for mode in [0o644, 0o640, 0o604, 0o620, 0o602, 0o610] {
        let p = write(tmp.path(), "open.psk", line.as_bytes(), mode);
        let e = PskKeys::load(&p).unwrap_err();
        assert!(
            matches!(e, PskError::Mode { mode: m, .. } if m == mode),
            "{mode:o}: {e}"
        );
        assert!(e.to_string().contains("chmod 600"), "{e}");
    }
}

#[test]
fn load_refuses_what_is_not_a_key_file() {
    let tmp = tempfile::tempdir().unwrap();
    let e = PskKeys::load(tmp.path().join("missing.psk")).unwrap_err();
    assert!(matches!(e, PskError::Io { .. }), "{e}");
    let e = PskKeys::load(tmp.path()).unwrap_err();
    assert!(matches!(e, PskError::NotAFile { .. }), "{e}");
    for empty in ["", "\n\n  \n"] {
        let p = write(tmp.path(), "empty.psk", empty.as_bytes(), 0o600);
        let e = PskKeys::load(&p).unwrap_err();
        assert!(matches!(e, PskError::Empty { .. }), "{e}");
    }
    // Larger than the bound: refused without being parsed.
    let mut big = format!("alice:{KEY16}\n").into_bytes();
    big.resize(MAX_FILE_LEN as usize + 1, b'\n');
    let p = write(tmp.path(), "big.psk", &big, 0o600);
    let e = PskKeys::load(&p).unwrap_err();
    assert!(matches!(e, PskError::TooLarge { .. }), "{e}");
    big.truncate(MAX_FILE_LEN as usize);
    let p = write(tmp.path(), "big.psk", &big, 0o600);
    assert_eq!(PskKeys::load(&p).unwrap().len(), 1);
    // A bad line: the path and the line's number.
    let p = write(
        tmp.path(),
        "bad.psk",
        format!("alice:{KEY16}\nbob:1234\n").as_bytes(),
        0o600,
    );
    let e = PskKeys::load(&p).unwrap_err().to_string();
    assert!(e.contains("bad.psk") && e.contains("line 2"), "{e}");
    assert!(e.contains("at least 16"), "{e}");
}

// ---- the handshake, against GnuTLS's client ----

/// Bound on one handshake with gnutls-cli (it takes milliseconds).
const HANDSHAKE_S: u64 = 30;

fn gnutls_cli() -> PathBuf {
    std::env::var_os("PATH")
        .and_then(|p| {
            std::env::split_paths(&p)
                .map(|d| d.join("gnutls-cli"))
                .find(|f| f.is_file())
        })
        .expect(
            "gnutls-cli is needed by the TLS-PSK tests and is not installed (package gnutls-bin)",
        )
}

/// Runs `gnutls-cli` as `user` with `key` and GnuTLS priority `priority`
/// against [`PskConfig::accept`] with `keys`: the server's outcome, the
/// client's exit success.
async fn handshake(
    keys: &str,
    user: &str,
    key: &str,
    priority: &str,
) -> (Result<String, String>, bool) {
    let config = PskConfig::new(PskKeys::parse(keys.as_bytes()).unwrap()).unwrap();
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = l.local_addr().unwrap().port().to_string();
    let client = tokio::process::Command::new(gnutls_cli())
        .args([
            "--pskusername",
            user,
            "--pskkey",
            key,
            "--priority",
            priority,
        ])
        .args(["-p", &port, "127.0.0.1"])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("gnutls-cli starts");
    tokio::time::timeout(Duration::from_secs(HANDSHAKE_S), async move {
        let (s, _) = l.accept().await.unwrap();
        let outcome = match config.accept(s).await {
            Ok((mut s, identity)) => {
                assert_eq!(s.ssl().version_str(), "TLSv1.3");
                // Until the client, at the end of its input, says goodbye.
                let _ = s.read_to_end(&mut Vec::new()).await;
                Ok(identity)
            }
            Err(e) => Err(e.to_string()),
        };
        let status = client.wait_with_output().await.unwrap().status;
        (outcome, status.success())
    })
    .await
    .expect("handshake timed out")
}

/// GnuTLS's default priority plus the PSK key exchanges, as qemu and
/// libnbd ask for.
const CLIENTS: &str = "NORMAL:+ECDHE-PSK:+DHE-PSK:+PSK";

#[tokio::test]
async fn gnutls_with_a_known_identity_and_its_key_is_accepted() {
    let keys = format!("bob:{}\nalice:{KEY16}\n", hex_of(32));
    let (outcome, client_ok) = handshake(&keys, "alice", KEY16, CLIENTS).await;
    assert_eq!(outcome, Ok("alice".to_string()));
    assert!(client_ok);
}

#[tokio::test]
async fn a_wrong_key_or_an_unknown_identity_fails_and_is_named() {
    let keys = format!("alice:{KEY16}\n");
    let other = "ffeeddccbbaa99887766554433221100";
    let (outcome, client_ok) = handshake(&keys, "alice", other, CLIENTS).await;
    let e = outcome.unwrap_err();
    assert!(e.contains("\"alice\"") && e.contains("wrong key"), "{e}");
    assert!(!client_ok);
    let (outcome, client_ok) = handshake(&keys, "mallory", KEY16, CLIENTS).await;
    let e = outcome.unwrap_err();
    assert!(e.contains("unknown TLS-PSK identity \"mallory\""), "{e}");
    assert!(!client_ok);
}

/// The key alone (psk_ke, no (EC)DHE) gives no forward secrecy: refused.
/// So is TLS 1.2.
#[tokio::test]
async fn psk_without_ecdhe_and_tls12_are_refused() {
    let keys = format!("alice:{KEY16}\n");
    let (outcome, client_ok) = handshake(&keys, "alice", KEY16, "NORMAL:-KX-ALL:+PSK").await;
    assert!(outcome.is_err() && !client_ok, "{outcome:?}");
    let (outcome, client_ok) = handshake(&keys, "alice", KEY16, "NORMAL:-KX-ALL:+ECDHE-PSK").await;
    assert_eq!(
        outcome,
        Ok("alice".to_string()),
        "ECDHE-PSK alone is enough"
    );
    assert!(client_ok);
    let tls12 = "NORMAL:-VERS-ALL:+VERS-TLS1.2:+ECDHE-PSK:+DHE-PSK:+PSK";
    let (outcome, client_ok) = handshake(&keys, "alice", KEY16, tls12).await;
    assert!(outcome.is_err() && !client_ok, "{outcome:?}");
}
