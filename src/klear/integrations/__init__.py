"""Adapters that run klear's losses and rewards inside other training frameworks (``klear.integrations.verl``)."""
