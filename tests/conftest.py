pytest_plugins = ["spark_dilation.testing.fixtures"]
