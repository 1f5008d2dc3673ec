"""kvrelay's example plugins: one of each entry-point group (see docs/plugins.md)."""
