"""The ``hora`` command line: run, check. Imports only base layers and rendezvous."""
