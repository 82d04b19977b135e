"""Install tfmulti: multi-device training for Keras 3 on TensorFlow."""

from setuptools import find_packages, setup

setup(
    name="tfmulti",
    version="0.1.0",
    description="Data, model, pipeline and tensor parallelism for Keras 3 on TensorFlow.",
    python_requires=">=3.10",
    packages=find_packages(include=["tfmulti", "tfmulti.*"]) + ["tfmulti.models"],
    package_data={"tfmulti.planner": ["hardware/*.json"]},
    # The reference models live in models/ but install as tfmulti.models, so a user's own
    # module named `models` is never shadowed.
    package_dir={"tfmulti.models": "models"},
    install_requires=[
        "tensorflow>=2.20,<2.22",
        "keras>=3.10,<3.16",
        "tensorboard>=2.20",
        "tensorboard-plugin-profile>=2.20",
        "absl-py>=2.1",
        "numpy>=1.26",
        "scikit-learn>=1.4",
        "matplotlib>=3.8",
    ],
    entry_points={
        "console_scripts": [
            "tfmulti-train=tfmulti.cli.train:main",
            "tfmulti-launch=tfmulti.cli.launch:main",
            "tfmulti-plan=tfmulti.cli.plan:main",
        ],
    },
    extras_require={
        "gpu": ["tensorflow[and-cuda]>=2.20,<2.22"],
        # Ray Train as a launcher (tfmulti.ray); Train V2's API, tested on 2.60.0.
        "ray": ["ray[train]>=2.60,<3"],
        "dev": [
            "ray[train]>=2.60,<3",
            "pytest>=8",
            "pytest-xdist>=3.5",
            "pytest-timeout>=2.3",
            "hypothesis>=6.100",
            "ruff>=0.6",
            "keras-hub>=0.32",
        ],
    },
)
