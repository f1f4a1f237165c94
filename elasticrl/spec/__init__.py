"""The job spec: typed, validated, every error names its field."""
from elasticrl.spec.load import SpecError, describe, dump_spec, explicit_fields, load_spec, read_raw, spec_to_dict
from elasticrl.spec.schema import JobSpec

__all__ = ["JobSpec", "SpecError", "describe", "dump_spec", "explicit_fields", "load_spec", "read_raw", "spec_to_dict"]
