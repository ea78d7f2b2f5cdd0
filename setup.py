from setuptools import find_packages, setup

setup(
    name="fairseq-moe-ext",
    version="0.1.0",
    description="Mixture-of-Experts training for stock fairseq, as a --user-dir plugin",
    packages=find_packages(include=["fairseq_moe_ext", "fairseq_moe_ext.*"]),
    package_data={"fairseq_moe_ext": ["config/*.yaml", "config/*/*.yaml"]},
    python_requires=">=3.9",
    install_requires=["torch>=2.0", "omegaconf"],
    extras_require={"fairseq": ["ve-fairseq==0.12.3"]},
    # Every tool of the plugin, beside fairseq's own fairseq-* scripts (python -m fairseq_moe_ext is the same).
    entry_points={"console_scripts": ["fairseq-moe = fairseq_moe_ext.console:main"]},
)
