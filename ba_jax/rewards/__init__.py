"""Verifiable rewards: math answer checking (`math`); code answer checking (`code`), which
runs programs in the sandbox (`sandbox`, `sandbox_launcher`, `sandbox_slots`, `sandbox_root`,
`sandbox_seccomp`, `sandbox_cgroup`)."""
