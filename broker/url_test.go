package broker_test

import (
	"context"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/broker"
	"github.com/onceflow/onceflow/internal/testsvc"
)

const secret = "S3cr3t-pw"

func TestOpen_RejectsBadURLsNamingTheAcceptedSchemes(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name, url, want string
		listsSchemes    bool
	}{
		{"empty", "", "URL is empty", true},
		{"blank", "   ", "URL is empty", true},
		{"unknown scheme", "pulsar://127.0.0.1:6650", `unknown scheme "pulsar"`, true},
		{"no scheme", "127.0.0.1:5672", "unknown scheme", true},
		{"no slashes", "amqp:127.0.0.1", "malformed", true},
		{"keywords", "host=127.0.0.1 user=app dbname=orders", `"host=127.0.0.1 user=app dbname=orders" is a libpq keyword/value string, not a URL`, true},
		{"DSN", "app@tcp(127.0.0.1:3306)/orders", `"app@tcp(127.0.0.1:3306)/orders" is a go-sql-driver DSN, not a URL`, true},
		{"fragment", "mem://x#y", "fragment", false},
		{"bad escape in query", "mem://x?group=%zz", "malformed query", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			_, err := broker.Open(context.Background(), tc.url, broker.Options{})
			require.ErrorContains(t, err, tc.want)
			if tc.listsSchemes {
				for _, s := range []string{"amqp://", "postgres://", "mysql://", "sqlite://", "nats://", "redis://", "kafka://", "mem://"} {
					require.ErrorContains(t, err, s)
				}
			}
		})
	}
}

func TestOpen_RejectsBadParametersNamingThem(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		url, want string
	}{
		{"mem://x?prefetch=-1", "prefetch"},
		{"mem://x?prefetch=many", "prefetch"},
		{"mem://x?nack_delay=soon", "nack_delay"},
		{"mem://x?ack_timeout=0", "ack_timeout"},
		{"mem://x?poll_interval=-1s", "poll_interval"},
		{"mem://x?group=", "group"},
		{"mem://x?group=a%20b", "ConsumerGroup"},
		{"mem://x?bogus=1", `unknown query parameter "bogus" (mem:// takes onceflow's group, prefetch, nack_delay, ack_timeout, poll_interval, connect_timeout)`},
	} {
		t.Run(tc.url, func(t *testing.T) {
			t.Parallel()
			_, err := broker.Open(context.Background(), tc.url, broker.Options{})
			require.ErrorContains(t, err, tc.want)
		})
	}
}

// A query parameter that neither onceflow, the scheme nor its client reads is refused before
// anything connects (the hosts here answer nothing), with an error that names it and lists the
// known ones; so is a mistyped one of onceflow's. A parameter the scheme or the client takes
// passes the check.
func TestOpen_RefusesUnknownParametersBeforeConnecting(t *testing.T) {
	t.Parallel()
	const common = "onceflow's group, prefetch, nack_delay, ack_timeout, poll_interval, connect_timeout"
	for _, tc := range []struct {
		url, known string
	}{
		{"amqp://guest:guest@127.0.0.1:1/?grup=x", common + "; broker/amqp's queue_type, delivery_limit, dead_letter_exchange; amqp091-go's auth_mechanism, heartbeat, connection_timeout, channel_max, cacertfile, certfile, keyfile, server_name_indication"},
		{"amqps://127.0.0.1:1/?heartbeat=10&queue_type=quorum&Group=x", common},
		{"nats://127.0.0.1:1?grup=x", common + ")"},
		{"redis://127.0.0.1:1/0?grup=x", common + "; go-redis's db, protocol, client_name"},
		{"kafka://127.0.0.1:1/?partitions=2&grup=x", common + "; broker/kafka's partitions, replication_factor)"},
		{"mem://x?grup=x", common + ")"},
		{"sqlite://" + t.TempDir() + "/q.db?grup=x", common + "; modernc.org/sqlite's _pragma"},
	} {
		t.Run(tc.url, func(t *testing.T) {
			t.Parallel()
			_, err := broker.Open(context.Background(), tc.url, broker.Options{ConnectTimeout: time.Second})
			param := "grup"
			if strings.Contains(tc.url, "Group") {
				param = "Group"
			}
			require.ErrorContains(t, err, `: unknown query parameter "`+param+`" (`)
			require.ErrorContains(t, err, tc.known)
			require.NotContains(t, err.Error(), "refused")
		})
	}
}

// The queues in PostgreSQL and MySQL pass the parameters that are not onceflow's to
// sqldb.Open, whose server refuses a setting it does not have: the error names the parameter
// and lists onceflow's too.
func TestOpen_SQLQueueUnknownParameterIsNamed(t *testing.T) {
	t.Parallel()
	for _, rawURL := range []string{testsvc.PostgresURL(t), testsvc.MySQLURL(t)} {
		sep := "?"
		if strings.Contains(rawURL, "?") {
			sep = "&"
		}
		_, err := broker.Open(context.Background(), rawURL+sep+"grup=x", broker.Options{})
		scheme, _, _ := strings.Cut(rawURL, ":")
		require.ErrorContains(t, err, `: unknown query parameter "grup" (`+scheme+`:// takes onceflow's group, prefetch, nack_delay, ack_timeout, poll_interval, connect_timeout; `)
		require.ErrorContains(t, err, "which the server checks at connect): ")
	}
}

// The values of the client's parameters that onceflow checks are named when they are wrong.
func TestOpen_AMQPClientParameterValuesAreChecked(t *testing.T) {
	t.Parallel()
	for _, p := range []string{"heartbeat=often", "connection_timeout=-1", "channel_max=70000"} {
		_, err := broker.Open(context.Background(), "amqp://127.0.0.1:1/?"+p, broker.Options{})
		name, value, _ := strings.Cut(p, "=")
		require.ErrorContains(t, err, "URL parameter "+name+`="`+value+`": want a whole number`)
	}
}

func TestOptions_Validate(t *testing.T) {
	t.Parallel()
	require.NoError(t, broker.Options{}.Validate())
	require.NoError(t, broker.Options{NackDelay: broker.NoNackDelay}.Validate())
	require.EqualError(t, broker.Options{Prefetch: -1}.Validate(), "broker: Options.Prefetch: -1 is negative (0 selects the default)")
	require.EqualError(t, broker.Options{NackDelay: -time.Second}.Validate(),
		"broker: Options.NackDelay: -1s is negative (0 selects the default, NoNackDelay disables the delay)")
	require.EqualError(t, broker.Options{AckTimeout: -time.Second}.Validate(), "broker: Options.AckTimeout: -1s is negative (0 selects the default)")
	require.EqualError(t, broker.Options{PollInterval: -time.Second}.Validate(), "broker: Options.PollInterval: -1s is negative (0 selects the default)")
	require.ErrorContains(t, broker.Options{ConsumerGroup: "a\tb"}.Validate(), "Options.ConsumerGroup")
	require.ErrorContains(t, broker.Options{ConsumerGroup: strings.Repeat("g", 201)}.Validate(), "Options.ConsumerGroup")
}

func TestOpen_URLParametersOverrideOptions(t *testing.T) {
	t.Parallel()
	b, err := broker.Open(context.Background(), "mem://"+testsvc.UniqueName("m")+"?group=from-url", broker.Options{ConsumerGroup: "from-options"})
	require.NoError(t, err)
	t.Cleanup(func() { _ = b.Close() })
	require.Equal(t, "from-url", b.ConsumerGroup())
}

// Every form of URL with a password, for each scheme: nothing listens on port 1, so Open fails
// after the driver has seen the credentials; neither the error nor String shows them.
func TestOpen_ErrorsNeverShowThePassword(t *testing.T) {
	t.Parallel()
	for _, raw := range []string{
		"amqp://user:" + secret + "@127.0.0.1:1/",
		"amqps://user:" + secret + "@127.0.0.1:1/vhost",
		"postgres://user:" + secret + "@127.0.0.1:1/db?sslmode=disable&connect_timeout=2",
		"postgresql://user@127.0.0.1:1/db?password=" + secret + "&sslmode=disable",
		"mysql://user:" + secret + "@127.0.0.1:1/db",
		"mariadb://user:" + secret + "@127.0.0.1:1/db",
		"nats://user:" + secret + "@127.0.0.1:1",
		"nats://" + secret + "@127.0.0.1:1",
		"redis://:" + secret + "@127.0.0.1:1/0",
		"rediss://user:" + secret + "@127.0.0.1:1/0",
		"amqp://user:" + url.PathEscape(secret+"/?#") + "@127.0.0.1:1/",
		// Malformed: the password's '/' or '@' not percent-encoded, a bad escape.
		"amqp://user:S3cr3t/pw@127.0.0.1:1/",
		"redis://user:S3cr3t@pw@127.0.0.1:1/",
		"postgres://user:S3cr3t-pw%zz@127.0.0.1:1/db",
		"user:" + secret + "@127.0.0.1:1",
		// Not URLs: libpq keyword/value strings and go-sql-driver DSNs.
		"host=127.0.0.1 port=1 user=app password=" + secret + " dbname=orders",
		"host=127.0.0.1 port=1 password='" + secret + " and more' dbname=orders",
		`host=127.0.0.1 password='S3cr3t\'s' dbname=orders`,
		"host=127.0.0.1 password='" + secret,
		"user:" + secret + "@tcp(127.0.0.1:1)/db",
		"user:" + secret + "@unix(/tmp/mysql.sock)/db?parseTime=true",
		"user:" + secret + "@/db",
		// A query parameter that does not decode beside the password.
		"postgres://user@127.0.0.1:1/db?password=" + secret + "&x=%zz",
	} {
		t.Run(raw, func(t *testing.T) {
			t.Parallel()
			b, err := broker.Open(context.Background(), raw, broker.Options{})
			require.Error(t, err)
			require.Nil(t, b)
			require.NotContains(t, err.Error(), "S3cr3t")
		})
	}
}

func TestBroker_StringHidesThePassword(t *testing.T) {
	t.Parallel()
	t.Run("postgres", func(t *testing.T) {
		t.Parallel()
		// Trust authentication accepts any password.
		raw := withPassword(t, testsvc.PostgresURL(t), secret)
		b, err := broker.Open(context.Background(), raw, broker.Options{})
		require.NoError(t, err)
		t.Cleanup(func() { _ = b.Close() })
		require.NotContains(t, b.String(), secret)
		require.Contains(t, b.String(), "xxxxx")
	})
	t.Run("nats token", func(t *testing.T) {
		t.Parallel()
		// A server without authentication accepts any token.
		u, err := url.Parse(testsvc.NATSURL(t))
		require.NoError(t, err)
		u.User = url.User(secret)
		b, err := broker.Open(context.Background(), u.String(), broker.Options{})
		require.NoError(t, err)
		t.Cleanup(func() { _ = b.Close() })
		require.NotContains(t, b.String(), secret)
		require.Contains(t, b.String(), "xxxxx")
	})
	for _, tc := range []struct {
		name string
		url  func(t testing.TB) string
	}{
		{"amqp", testsvc.AMQPURL},
		{"mysql", testsvc.MySQLURL},
		{"redis", testsvc.RedisURL},
	} {
		t.Run(tc.name+" wrong password", func(t *testing.T) {
			t.Parallel()
			_, err := broker.Open(context.Background(), withPassword(t, tc.url(t), secret), broker.Options{})
			require.Error(t, err, "the server should refuse the password")
			require.NotContains(t, err.Error(), secret)
		})
	}
}

func withPassword(t testing.TB, raw, password string) string {
	u, err := url.Parse(raw)
	require.NoError(t, err)
	user := "onceflow-nobody" // a user that no test server knows
	if u.User != nil && u.User.Username() != "" {
		user = u.User.Username()
	}
	u.User = url.UserPassword(user, password)
	return u.String()
}
