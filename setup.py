"""Where the packages come from, beside pyproject.toml's metadata.

The studies (`experiments/`) and their gin configs (`configs/`) stay at the repository's top
level and install inside the package, as `specjax.experiments` and `specjax/configs/*.gin`:
nothing lands in site-packages under a generic top-level name, and `specjax run NAME` finds
the shipped configs from any directory (`specjax.sweeps.launch.CONFIG_DIR`). An editable
install maps the same names onto the checkout's directories.
"""

from setuptools import find_packages, setup

setup(
    packages=find_packages(include=["specjax", "specjax.*"])
    + ["specjax.experiments", "specjax.configs"],
    package_dir={"specjax.experiments": "experiments", "specjax.configs": "configs"},
    package_data={"specjax": ["embedded/*/*", "embedded/heads/*/*", "models/*.cc"],
                  "specjax.configs": ["*.gin"]},
)
