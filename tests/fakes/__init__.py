"""Test doubles that implement real interfaces (one copy each; import, never copy them).

``fake_llmdatadist`` stands in for CANN's ``llm_datadist`` module, which cannot run here.
"""
