package messagedata_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/messagedata"
)

func TestParseTimestamp_ReadsWhatProducersWrite(t *testing.T) {
	t.Parallel()
	at := func(s string) time.Time {
		ts, err := time.Parse(time.RFC3339Nano, s)
		require.NoError(t, err)
		return ts
	}
	for _, tc := range []struct {
		in   string
		want time.Time
	}{
		{"2026-12-06T10:11:12.123456789Z", at("2026-12-06T10:11:12.123456789Z")}, // onceflow, Go
		{"2026-12-06T11:11:12+01:00", at("2026-12-06T10:11:12Z")},                // RFC 3339 with an offset
		{"2026-12-06 11:11:12.5+01:00", at("2026-12-06T10:11:12.5Z")},            // Python str() of an aware datetime
		{"2026-12-06T10:11:12.123456", at("2026-12-06T10:11:12.123456Z")},        // Python datetime.now().isoformat()
		{"2026-12-06T10:11:12", at("2026-12-06T10:11:12Z")},                      // isoformat() at a whole second
		{"2026-12-06 10:11:12.123456", at("2026-12-06T10:11:12.123456Z")},        // Python str() of a naive datetime
		{"1796530389", time.Unix(1796530389, 0)},                                 // Go Unix(), Python int(time.time())
		{"1796530389.25", time.Unix(1796530389, 250_000_000)},                    // Python time.time()
		{"1796530389250", time.UnixMilli(1796530389250)},                         // milliseconds
		{"1796530389250.5", time.Unix(1796530389, 250_500_000)},                  // a fraction of a millisecond
		{"99999999999", time.Unix(99999999999, 0)},                               // the last count read as seconds
		{"100000000000", time.UnixMilli(100000000000)},                           // the first read as milliseconds
		{"0", time.Unix(0, 0)},
	} {
		got, err := messagedata.ParseTimestamp(tc.in)
		require.NoError(t, err, tc.in)
		require.True(t, tc.want.Equal(got), "%s: got %s, want %s", tc.in, got, tc.want)
		again, _ := messagedata.ParseTimestamp(tc.in)
		require.Equal(t, got, again, "the same value gives the same time")
	}
}

func TestParseTimestamp_RefusesWhatIsNoTime(t *testing.T) {
	t.Parallel()
	for _, in := range []string{
		"", "yesterday", "1796530389x", "-1796530389", "+1796530389", "1796530389.1234567890",
		"100000000000000", "1.2e9", "2026-12-06", "06/12/2026 10:11", "2026-12-06T25:00:00", "0x6b",
	} {
		_, err := messagedata.ParseTimestamp(in)
		require.Error(t, err, "%q", in)
		require.ErrorContains(t, err, `header onceflow_timestamp holds "`+in+`"`)
	}
}
