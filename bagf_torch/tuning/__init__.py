"""Tuning one problem: the Tuner, the search strategies, measurement, the isolated worker and replay."""
