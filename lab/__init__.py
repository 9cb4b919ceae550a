"""lab: a VM lab orchestrator for benchmarking hypervisors, guest OSes, NIC models and tuning."""

from pathlib import Path

__version__ = "0.1.0"

# The project checkout: templates/, images/ and packer/ live beside the package.
PROJECT_ROOT = Path(__file__).resolve().parent.parent
TEMPLATES_DIR = PROJECT_ROOT / "templates"
IMAGES_DIR = PROJECT_ROOT / "images"
PACKER_DIR = PROJECT_ROOT / "packer"
