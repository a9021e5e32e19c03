"""Distribution policies, one file each; the file name is the YAML value
``distribution_policy.name`` and the module's ``POLICY`` is the policy."""
