"""Latent groups (`LatentSpec`: compressed or latent K/V entries, e.g. DeepSeek MLA): paged
entries every query reads, so their books are those of full attention under their own kind."""

from __future__ import annotations

from tandem.engine_service.cache.full_attention_manager import FullAttentionManager


class LatentManager(FullAttentionManager):
    """Block ids of a latent group: held to the end, a hit needs every leading block cached."""

    kind = "latent"
