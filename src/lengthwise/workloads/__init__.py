"""Where sequence lengths come from: published profiles, lengths files, real corpora, and the
deterministic, resumable sampler that cuts them into global batches. No PyTorch here."""

from lengthwise.workloads.corpus import ByteTokenizer, Corpus, load_corpus
from lengthwise.workloads.lengths import (THRESHOLDS, apply_overlong, length_stats,
                                          read_lengths)
from lengthwise.workloads.profiles import LengthProfile, get_profile, profile_names
from lengthwise.workloads.sampler import GlobalBatch, GlobalBatchSampler
from lengthwise.workloads.source import (LengthSource, corpus_source, lengths_file_source,
                                         profile_source)

__all__ = ["ByteTokenizer", "Corpus", "GlobalBatch", "GlobalBatchSampler", "LengthProfile",
           "LengthSource", "THRESHOLDS", "apply_overlong", "corpus_source", "get_profile",
           "length_stats", "lengths_file_source", "load_corpus", "profile_names",
           "profile_source", "read_lengths"]
