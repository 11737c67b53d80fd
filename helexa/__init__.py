"""helexa: self-hosted serving of open-weight LLMs (node + gateway in one package)."""

__version__ = "0.1.0"
