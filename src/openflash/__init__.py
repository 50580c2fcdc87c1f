"""openflash: an open implementation of the DeepSeek-V4.1-Flash architecture."""

__version__ = "0.1.0"
