"""Criteo-format data: dataset specs, the formats and their transforms, synthetic data with a
planted signal, resumable preparation on Ray Data, and the streams that feed the trainer."""
