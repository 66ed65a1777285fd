"""Pulsar test support: the Java transaction probe (``TxnProbe.java``) and how to run it."""
