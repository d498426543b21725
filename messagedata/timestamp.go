package messagedata

import (
	"fmt"
	"strconv"
	"strings"
	"time"
)

// Layouts of ParseTimestamp besides RFC 3339: ISO 8601 with a space for the T and a zone
// offset (Python's str() of an aware datetime), and ISO 8601 without a zone, with a T or a
// space (Python's isoformat() and str() of a naive datetime). The fraction of a second is
// optional in each.
var (
	zonedLayouts = []string{time.RFC3339Nano, "2006-01-02 15:04:05.999999999Z07:00"}
	localLayouts = []string{"2006-01-02T15:04:05.999999999", "2006-01-02 15:04:05.999999999"}
)

// Bounds of an epoch count in ParseTimestamp: below epochMillis it counts seconds (up to the
// year 5138), from there up to epochEnd milliseconds (from 1973 on).
const (
	epochMillis = 1e11
	epochEnd    = 1e14
)

// ParseTimestamp reads the value of HeaderTimestamp as producers write it:
//
//   - an RFC 3339 time, as onceflow writes it ("2026-12-06T10:11:12.123456789Z"), or with a
//     space for the T ("2026-12-06 10:11:12+01:00");
//   - an ISO 8601 date and time without a zone offset, taken as UTC, as Python's
//     datetime.now().isoformat() writes it ("2026-12-06T10:11:12.123456"), or with a space for
//     the T;
//   - a count of seconds since the Unix epoch, as Go's time.Now().Unix() and Python's
//     int(time.time()) write it, with a fraction or not ("1796530389", "1796530389.25"); or of
//     milliseconds ("1796530389250"): a count from 1e11 on is milliseconds (seconds below it
//     reach the year 5138; milliseconds from it start in 1973), and one from 1e14 on is refused.
//
// The same value always gives the same time, so that every copy of a message maps to the same
// key of a duplicate detection that includes the timestamp. Anything else is an error that
// quotes the value.
func ParseTimestamp(v string) (time.Time, error) {
	for _, layout := range zonedLayouts {
		if t, err := time.Parse(layout, v); err == nil {
			return t, nil
		}
	}
	for _, layout := range localLayouts {
		if t, err := time.ParseInLocation(layout, v, time.UTC); err == nil {
			return t, nil
		}
	}
	if t, ok := parseEpoch(v); ok {
		return t, nil
	}
	return time.Time{}, fmt.Errorf("header %s holds %q: not an RFC 3339 or ISO 8601 time, nor epoch seconds or milliseconds", HeaderTimestamp, v)
}

// parseEpoch reads a decimal count of seconds or milliseconds since the Unix epoch, with an
// optional fraction, exactly (no floating point).
func parseEpoch(v string) (time.Time, bool) {
	whole, frac, _ := strings.Cut(v, ".")
	n, err := strconv.ParseInt(whole, 10, 64)
	if err != nil || whole == "" || whole[0] == '+' || whole[0] == '-' || n >= epochEnd || len(frac) > 9 {
		return time.Time{}, false
	}
	for _, c := range frac {
		if c < '0' || c > '9' {
			return time.Time{}, false
		}
	}
	// The fraction in billionths of the unit.
	billionths, _ := strconv.ParseInt((frac + "000000000")[:9], 10, 64)
	if n < epochMillis {
		return time.Unix(n, billionths).UTC(), true
	}
	return time.Unix(n/1000, (n%1000)*int64(time.Millisecond)+billionths/1000).UTC(), true
}
