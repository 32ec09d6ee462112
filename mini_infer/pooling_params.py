"""PoolingParams: what a request to an embedding or reranker model asks of its output (vLLM's names), validated on
creation; what the model allows (its hidden size, matryoshka dimensions, its task) is checked by the engine's
InputProcessor."""

from __future__ import annotations

from dataclasses import dataclass

from mini_infer.errors import InvalidRequestError


@dataclass(frozen=True, slots=True)
class PoolingParams:
    """dimensions: an embedding cut to its first `dimensions` values, then L2-normalised again (matryoshka models
    only: config.json's is_matryoshka or matryoshka_dimensions); normalize: L2-normalise the embedding (None: the
    model's default, true unless its sentence-transformers modules.json has no Normalize module). Both are for
    embeddings; a reranker's score takes neither."""

    dimensions: int | None = None
    normalize: bool | None = None

    def __post_init__(self) -> None:
        if self.dimensions is not None and (not isinstance(self.dimensions, int) or isinstance(self.dimensions, bool)
                                            or self.dimensions < 1):
            raise InvalidRequestError(f"dimensions must be an integer >= 1, got {self.dimensions!r}", "dimensions")
        if self.normalize not in (None, True, False):
            raise InvalidRequestError(f"normalize must be true or false, got {self.normalize!r}", "normalize")
