"""Pooling models (embeddings, classification, scoring): params, outputs and the runner."""
from runtime.pooling.outputs import (ClassificationOutput, ClassificationRequestOutput,
                                     EmbeddingOutput, EmbeddingRequestOutput, PoolingOutput,
                                     PoolingRequestOutput, ScoringOutput, ScoringRequestOutput)
from runtime.pooling.params import PoolingParams

__all__ = ["ClassificationOutput", "ClassificationRequestOutput", "EmbeddingOutput",
           "EmbeddingRequestOutput", "PoolingOutput", "PoolingParams", "PoolingRequestOutput",
           "ScoringOutput", "ScoringRequestOutput"]
