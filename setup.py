import re

from setuptools import find_packages, setup

with open("llmproxy/__init__.py") as f:
    version = re.search(r'__version__ = "([^"]+)"', f.read()).group(1)

setup(
    name="llmproxy",
    version=version,
    description="One OpenAI-compatible URL in front of a LAN's GPU hosts, on Twisted.",
    python_requires=">=3.11",
    # twisted.plugins is listed by hand: it has no __init__.py (it must not, or it
    # would shadow Twisted's own), so find_packages() would not see it.
    packages=[*find_packages(include=["llmproxy", "llmproxy.*"]), "twisted.plugins"],
    package_data={"llmproxy": ["py.typed"], "llmproxy.testing": ["demo.json"],
                  "llmproxy.observe": ["page/*"]},
    # Only what llmproxy imports. Twisted is bounded above by the next release
    # nobody has tested: the speedups' guards follow 26.10's code (a newer one
    # turns them off, loudly), and tests/test_speedups.py fails on a mismatch.
    # [tls,http2]: the TLS listener's HTTP/2 (h2, priority) and its TLS parts.
    install_requires=[
        "twisted[tls,http2]>=26.10,<27",
        "treq>=26.7",
        "service-identity>=24.1",
        "zope.interface>=6.0",
        "prometheus_client>=0.20",
        "python-multipart>=0.0.9",
        "httptools>=0.6",
    ],
    extras_require={
        "test": [
            "pytest>=8",
            "pytest-twisted>=1.14",
            "pytest-timeout>=2.3",
            # `make pytest` runs the suite on two workers, one test file each at a time.
            "pytest-xdist>=3.5",
            "hypothesis>=6.100",
            "openai>=1.40",
            "anthropic>=0.30",
            "trustme>=1.1",
            # An HTTP/2 client (tests/test_integration_http2.py); h2 comes with
            # twisted[http2].
            "httpx2[http2]>=2.16",
            "selenium>=4.20",
            "ruff>=0.6",
            "mypy>=1.10",
            "mypy-zope>=1.0.5",
            # CI builds the docs site as part of `make test` (`make docs`).
            "mkdocs>=1.6",
            "mkdocs-material>=9.5",
            # The tracing tests (tests/test_*tracing*.py): the [otel] extra, and the
            # protobuf messages their OTLP receiver decodes.
            "opentelemetry-sdk>=1.30",
            "opentelemetry-exporter-otlp-proto-http>=1.30",
            "opentelemetry-proto>=1.30",
        ],
        # OpenTelemetry traces (the config's `tracing`): `pip install '.[otel]'`.
        "otel": [
            "opentelemetry-sdk>=1.30",
            "opentelemetry-exporter-otlp-proto-http>=1.30",
        ],
        # The docs site (mkdocs.yml, docs/): `pip install '.[docs]'`, `make docs`.
        "docs": [
            "mkdocs>=1.6",
            "mkdocs-material>=9.5",
        ],
    },
    # The launcher that starts twistd with SIGHUP ignored (see the script).
    scripts=["bin/llmproxy-twistd"],
    entry_points={
        "console_scripts": [
            "llmproxy=llmproxy.cli:main",
            "llmproxy-simengine=llmproxy.testing.simengine:main",
            "llmproxy-agent=llmproxy.agent.main:main",
        ],
    },
)
