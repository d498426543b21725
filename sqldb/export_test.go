package sqldb

// ParseURL exposes parseURL to the tests of package sqldb_test, which import the drivers.
func ParseURL(rawURL string) (driverName, dsn, path, redacted string, err error) {
	t, err := parseURL(rawURL)
	if err != nil {
		return "", "", "", "", err
	}
	return t.driver.DriverName, t.dsn, t.path, t.redacted, nil
}
