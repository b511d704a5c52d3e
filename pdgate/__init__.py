"""pdgate: the control plane for prefill/decode disaggregated serving on vLLM.

The code lives in the repository's top-level folders (`router/`, `metaserver/`, `connector/`,
`deploy/`) and installs under this one name (`pdgate.router`, `pdgate.metaserver`, ...), so that
`pip install pdgate` adds a single top-level name to site-packages instead of generic ones that could
collide with anything. `pyproject.toml` maps each folder to its `pdgate.*` package.
"""

__version__ = "0.1.0"
