"""What the tests share that is not a fixture: the lab CLI run from a test, lab.toml writers for
the local and fake backends, Chromium, the leak sweep, the ordering and rerun plugins, and the
scripts make runs (chaos, scalebench, packer_modern, verdictrates). Importable as `support` (pyproject
puts tests/ on sys.path, beside fakes, pve_emulator and smartos_emulator)."""
