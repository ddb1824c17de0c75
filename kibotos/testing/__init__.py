"""Test helpers that ship with kibotos (real fakes, not mocks), usable from tests/ and
bench/ alike."""
