"""Byte units: GB is 10^9 bytes (what vendors print), GiB 2^30 (what memory sizes use)."""

GB = 10**9
GiB = 2**30
