"""Tests of the Wire layer (`omni.transport`): sockets, RPC, wire codec, security, movers."""
