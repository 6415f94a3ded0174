//! A log store on a real block device (a loop device over a file): it is
//! formatted, written, reopened and read back, and a block device that
//! another program holds exclusively (as a mount or md would) is refused
//! with a clear error. Needs root and a free loop device (CI has both).

use shoal_store::LogStore;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Size of the file behind the loop device, in bytes.
const BACKING_BYTES: u64 = 128 << 20;

/// A loop device over a file, detached on drop.
struct Loop {
    dev: PathBuf,
}

impl Loop {
    fn attach(file: &Path) -> Loop {
        let out = Command::new("losetup")
            .args(["-f", "--show"])
            .arg(file)
            .output()
            .expect("running losetup: this test needs util-linux's losetup");
        assert!(
            out.status.success(),
            "no loop device: this test needs root and loop devices: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let dev = String::from_utf8_lossy(&out.stdout).trim().to_string();
        Loop { dev: dev.into() }
    }
}

impl Drop for Loop {
    fn drop(&mut self) {
        let _ = Command::new("losetup").arg("-d").arg(&self.dev).status();
    }
}

#[test]
fn a_store_on_a_block_device_works_and_one_held_elsewhere_is_refused() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let backing = tmp.path().join("disk.img");
    let f = std::fs::File::create(&backing).expect("create");
    f.set_len(BACKING_BYTES).expect("set_len");
    drop(f);
    let lo = Loop::attach(&backing);

    // Formatted with the device's own size, written, reopened, read.
    {
        let s = LogStore::create(&lo.dev, 0, "c1").expect("create on the block device");
        s.create_component(1, 1, 1 << 20).expect("component");
        s.write(1, 4096, &[7u8; 4096]).expect("write");
        s.sync().expect("sync");
    }
    {
        let s = LogStore::open(&lo.dev).expect("reopen");
        let mut buf = vec![0u8; 4096];
        s.read(1, 4096, &mut buf).expect("read");
        assert_eq!(buf, vec![7u8; 4096]);
        // The store holds it exclusively: another exclusive opener (a
        // mount, md) is refused by the kernel while it is open.
        let other = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_EXCL)
            .open(&lo.dev);
        let busy = other.expect_err("an exclusive open beside the store");
        assert_eq!(busy.raw_os_error(), Some(libc::EBUSY), "{busy}");
    }

    // Held exclusively by another program: refused, saying so.
    let holder = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_EXCL)
        .open(&lo.dev)
        .expect("exclusive open");
    for (what, r) in [
        ("open", LogStore::open(&lo.dev)),
        ("create", LogStore::create(&lo.dev, 0, "c1")),
    ] {
        let Err(e) = r else {
            panic!("{what} of a block device another program holds went through");
        };
        assert!(e.to_string().contains("in use by the system"), "{e}");
    }
    drop(holder);
    LogStore::open(&lo.dev).expect("open once released");
}
