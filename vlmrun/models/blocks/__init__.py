"""Blocks shared by several model families: text decoders, the hybrid decoder, vision towers."""
