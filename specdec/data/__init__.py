"""Data (layer 4): local text tasks built from Debian package descriptions (`debian`) and the shared
English+German SentencePiece vocabulary (`vocab`)."""

from specdec.data.debian import DATASETS, SPLITS, load
from specdec.data.vocab import Vocabulary, load_vocabulary, seqio_vocabulary

__all__ = ["DATASETS", "SPLITS", "load", "Vocabulary", "load_vocabulary", "seqio_vocabulary"]
