"""Measured op-profile databases, one JSON file per device (written by `autoplan profile`)."""
