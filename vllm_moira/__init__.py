"""Moira: sparse-decode attention backend for vLLM 0.30.0.

This package is an overlay mirroring vLLM's package tree: ``build.sh`` copies every file
below ``vllm_moira/`` (except this top-level ``__init__.py``) to the same relative path in
the installed ``vllm`` package, e.g. ``vllm_moira/v1/attention/backends/moira.py`` becomes
``vllm/v1/attention/backends/moira.py``, after applying ``patches/series``.
"""

__version__ = "0.1.0"
VLLM_VERSION = "0.30.0"
