"""The package's version: a leaf module (it imports nothing), so any module can name the version
without importing the package root (``hf_vkv/__init__.py`` re-exports it)."""

__version__ = "0.1.0"
