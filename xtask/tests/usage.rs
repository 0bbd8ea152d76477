//! `cargo xtask` answers help and wrong commands without running anything.

use std::process::Command;

fn xtask(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_xtask")).args(args).output().expect("xtask runs")
}

#[test]
fn help_prints_the_usage_and_succeeds() {
    for flag in ["--help", "-h", "help"] {
        let output = xtask(&[flag]);
        assert_eq!(output.status.code(), Some(0), "{flag}");
        let stdout = String::from_utf8_lossy(&output.stdout);
        assert!(stdout.starts_with("usage: cargo xtask ci"), "{flag}: {stdout}");
        assert!(output.stderr.is_empty(), "{flag}");
    }
}

#[test]
fn a_wrong_command_is_a_usage_error() {
    for args in [&[][..], &["bogus"][..]] {
        let output = xtask(args);
        assert_eq!(output.status.code(), Some(2), "{args:?}");
        assert!(String::from_utf8_lossy(&output.stderr).contains("usage: cargo xtask"), "{args:?}");
    }
}
