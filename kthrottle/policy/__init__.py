"""Pure quota decisions (KIP-55, KIP-124): time is passed in, never read."""
