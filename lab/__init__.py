"""lab: a VM lab orchestrator for benchmarking hypervisors, guest OSes, NIC models and tuning."""

import os
from pathlib import Path

# The one place the version is written (pyproject reads it: [tool.setuptools.dynamic]).
__version__ = "0.1.0"

PACKAGE_DIR = Path(__file__).resolve().parent

# Shipped with the package: what a run renders and builds from. In a checkout lab/templates and
# lab/packer are symbolic links to the repository's top-level templates/ and packer/; a wheel holds
# copies. Resolved, so paths read as the repository's own in a checkout.
TEMPLATES_DIR = (PACKAGE_DIR / "templates").resolve()
PACKER_DIR = (PACKAGE_DIR / "packer").resolve()

# The directory that holds lab/: the repository when run from a checkout (`make`, the tests), the
# site-packages directory of an installed package.
PROJECT_ROOT = PACKAGE_DIR.parent
IN_CHECKOUT = (PROJECT_ROOT / "pyproject.toml").is_file() and (PROJECT_ROOT / "images" / "README.md").is_file()

# How a user gets the golden image and the system packages: the Makefile in a checkout (it installs
# what is missing first), else the command and the docs' list (docs/dependencies.md).
BUILD_IMAGE = "make images" if IN_CHECKOUT else "lab images build debian12"
SETUP = "make setup" if IN_CHECKOUT else "install the system packages the docs list (docs/dependencies.md)"

IMAGES_ENV = "LAB_IMAGES_DIR"
BUILD_ENV = "LAB_BUILD_DIR"


def _user_dir(env: str, checkout: str, root: str, xdg: str, xdg_default: str, leaf: str) -> Path:
    """$env when set; in a checkout its `checkout` directory; else `root` for root, else the XDG
    directory (`xdg`, default ~/`xdg_default`) + lab/`leaf`. Never inside site-packages."""
    given = os.environ.get(env)
    if given:
        return Path(given).expanduser().resolve()
    if IN_CHECKOUT:
        return PROJECT_ROOT / checkout
    if os.geteuid() == 0:
        return Path(root)
    return Path(os.environ.get(xdg) or Path.home() / xdg_default) / "lab" / leaf


# Built images and the lab's SSH key (images/README.md): large, kept across runs.
IMAGES_DIR = _user_dir(IMAGES_ENV, "images", "/var/lib/lab/images", "XDG_DATA_HOME", ".local/share", "images")
# Image builds' intermediate files and logs, Packer's ISO cache, the git workload's repositories:
# can be deleted at any time.
BUILD_DIR = _user_dir(BUILD_ENV, "build", "/var/cache/lab/build", "XDG_CACHE_HOME", ".cache", "build")
