"""The checks wing: every preflight check, above the stages whose rules it reads."""
