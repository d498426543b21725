package broker

// RegisteredParams returns the query parameters that scheme registered, for the test that
// checks docs/brokers.md against them.
func RegisteredParams(scheme string) (Params, bool) {
	r, err := lookup(scheme)
	return r.params, err == nil
}

// CommonParams are the query parameters of every scheme.
var CommonParams = commonParams.Names

// Inspectable reports whether Peek, Move and Delete work on scheme, as the table of schemes
// says.
func Inspectable(scheme string) bool {
	info, _ := schemeInfoOf(scheme)
	return info.inspect
}

// CanonicalSchemes lists the canonical schemes of Open.
func CanonicalSchemes() []string {
	out := make([]string, len(schemes))
	for i, s := range schemes {
		out[i] = s.name
	}
	return out
}
