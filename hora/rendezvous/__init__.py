"""Rendezvous: who am I, who are my peers. Launcher env detection and the key-value store."""
