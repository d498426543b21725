package redact_test

import (
	"errors"
	"fmt"
	"io"
	"net/url"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/internal/redact"
)

// Every form of connection string onceflow may be given, with where its secret is: String must
// hide it, and Error must remove it from an error that echoes the string or the secret.
func TestString_HidesTheSecretOfEveryForm(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name   string
		in     string
		form   redact.Form
		want   string
		secret string // "" when the string holds none
		// tail is true when the secret is in a part that does not parse: Error removes it
		// where the string is echoed, not when the secret is echoed alone.
		tail bool
	}{
		// URLs.
		{"URL password", "postgres://app:S3cr3t@db:5432/orders?sslmode=disable", redact.URL, "postgres://app:xxxxx@db:5432/orders?sslmode=disable", "S3cr3t", false},
		{"URL percent-encoded password", "mysql://app:S3cr3t%40%2F%3F@db/orders", redact.URL, "mysql://app:xxxxx@db/orders", "S3cr3t@/?", false},
		{"URL password parameter", "postgres://app@db/orders?password=S3cr3t&sslmode=disable", redact.URL, "postgres://app@db/orders?password=xxxxx&sslmode=disable", "S3cr3t", false},
		{"URL password parameter in upper case", "postgres://db/orders?Password=S3cr3t", redact.URL, "postgres://db/orders?Password=xxxxx", "S3cr3t", false},
		{"URL sslpassword parameter", "postgres://db/orders?sslpassword=S3cr3t", redact.URL, "postgres://db/orders?sslpassword=xxxxx", "S3cr3t", false},
		{"URL token parameter", "postgres://db/orders?token=S3cr3t", redact.URL, "postgres://db/orders?token=xxxxx", "S3cr3t", false},
		{"URL of another scheme", "oracle://scott:S3cr3t@db/orcl", redact.URL, "oracle://scott:xxxxx@db/orcl", "S3cr3t", false},
		{"AMQP", "amqp://guest:guest@127.0.0.1:5672/", redact.URL, "amqp://guest:xxxxx@127.0.0.1:5672/", "", false},
		{"NATS token", "nats://S3cr3t@127.0.0.1:4222", redact.URL, "nats://xxxxx@127.0.0.1:4222", "S3cr3t", false},
		{"NATS user and password", "nats://u:S3cr3t@127.0.0.1:4222", redact.URL, "nats://u:xxxxx@127.0.0.1:4222", "S3cr3t", false},
		{"NATS token parameter", "nats://127.0.0.1:4222?token=S3cr3t", redact.URL, "nats://127.0.0.1:4222?token=xxxxx", "S3cr3t", false},
		{"Redis password without user", "redis://:S3cr3t@127.0.0.1:6379/0", redact.URL, "redis://:xxxxx@127.0.0.1:6379/0", "S3cr3t", false},
		{"'@' in the password", "redis://user:S3cr3t@pw@127.0.0.1:1/", redact.URL, "redis://user:xxxxx@127.0.0.1:1/", "S3cr3t@pw", false},
		{"user without password", "mysql://root@127.0.0.1:3306/test", redact.URL, "mysql://root@127.0.0.1:3306/test", "", false},
		{"SQLite", "sqlite:///tmp/q.db?prefetch=4", redact.URL, "sqlite:///tmp/q.db?prefetch=4", "", false},
		{"mem", "mem://tests", redact.URL, "mem://tests", "", false},
		{"SQLite path with '@'", "sqlite:me@home.db", redact.URL, "sqlite://(malformed URL)", "", false},
		{"file path", "/var/lib/onceflow/app.db", redact.URL, "/var/lib/onceflow/app.db", "", false},
		{"'/' in the password", "amqp://u:S3cr3t/x@h/", redact.URL, "amqp://(malformed URL)", "S3cr3t/x", false},
		{"'#' in the password", "postgres://app:12#S3cr3t@db/orders", redact.URL, "postgres://(malformed URL)", "12#S3cr3t", false},
		{"bad escape in the password", "postgres://app:S3cr3t%zz@db/orders", redact.URL, "postgres://(malformed URL)", "S3cr3t%zz", false},
		{"space in the password", "postgres://app:S3cr3t x@db/orders", redact.URL, "postgres://(malformed URL)", "S3cr3t x", false},
		{"bad escape in the password parameter", "postgres://db/orders?password=S3cr3t%zz&sslmode=disable", redact.URL, "postgres://db/orders?password=xxxxx&sslmode=disable", "S3cr3t%zz", false},
		{"bad escape beside the password parameter", "postgres://db/orders?x=%zz;password=S3cr3t", redact.URL, "postgres://db/orders?x=%zz;password=xxxxx", "S3cr3t", false},
		{"host and port", "127.0.0.1:5432", redact.URL, "(malformed URL)", "", false},
		{"colons", "::", redact.URL, "(malformed URL)", "", false},
		{"empty", "", redact.URL, "", "", false},

		// libpq keyword/value strings.
		{"keywords", "host=db port=5432 user=app password=S3cr3t dbname=orders", redact.Keywords,
			"host=db port=5432 user=app password=xxxxx dbname=orders", "S3cr3t", false},
		{"keywords, quoted password", "host=db password='S3cr3t a b' dbname=orders", redact.Keywords,
			"host=db password=xxxxx dbname=orders", "S3cr3t a b", false},
		{"keywords, escaped quote", `host=db password='S3cr3t\'s' dbname=orders`, redact.Keywords,
			"host=db password=xxxxx dbname=orders", "S3cr3t's", false},
		{"keywords, escaped space", `password=S3cr3t\ x host=db`, redact.Keywords, "password=xxxxx host=db", "S3cr3t x", false},
		{"keywords, spaces around '='", "  host = db password = S3cr3t", redact.Keywords, "  host = db password = xxxxx", "S3cr3t", false},
		{"keywords, sslpassword", "sslpassword=S3cr3t sslkey=/etc/key.pem", redact.Keywords, "sslpassword=xxxxx sslkey=/etc/key.pem", "S3cr3t", false},
		{"keywords, dbname is a URL", "dbname='postgres://app:S3cr3t@db/orders' connect_timeout=2", redact.Keywords,
			"dbname='postgres://app:xxxxx@db/orders' connect_timeout=2", "S3cr3t", false},
		{"keywords, dbname is keywords", "dbname='user=app password=S3cr3t'", redact.Keywords, "dbname='user=app password=xxxxx'", "S3cr3t", false},
		{"keywords, unterminated quote", "host=db password='S3cr3t", redact.Keywords, "host=db (malformed)", "S3cr3t", true},
		{"keywords, key without '='", "host=db oops password=S3cr3t", redact.Keywords, "host=db (malformed)", "S3cr3t", true},
		{"keywords without secret", "host=db dbname='my orders'", redact.Keywords, "host=db dbname='my orders'", "", false},

		// go-sql-driver DSNs.
		{"DSN", "user:S3cr3t@tcp(127.0.0.1:3306)/db", redact.DSN, "user:xxxxx@tcp(127.0.0.1:3306)/db", "S3cr3t", false},
		{"DSN over a socket", "user:S3cr3t@unix(/var/run/mysqld/mysqld.sock)/db?parseTime=true", redact.DSN,
			"user:xxxxx@unix(/var/run/mysqld/mysqld.sock)/db?parseTime=true", "S3cr3t", false},
		{"DSN, ':', '@' and '/' in the password", "app:S3:cr@t/3t@tcp(db:3306)/orders", redact.DSN, "app:xxxxx@tcp(db:3306)/orders", "S3:cr@t/3t", false},
		{"DSN without address", "app:S3cr3t@/orders", redact.DSN, "app:xxxxx@/orders", "S3cr3t", false},
		{"DSN without database", "user:S3cr3t@127.0.0.1:1", redact.DSN, "user:xxxxx@127.0.0.1:1", "S3cr3t", false},
		{"DSN host without net", "app:S3cr3t@db.internal/orders", redact.DSN, "app:xxxxx@db.internal/orders", "S3cr3t", false},
		{"DSN without password", "root@tcp(127.0.0.1:3306)/test", redact.DSN, "root@tcp(127.0.0.1:3306)/test", "", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			require.Equal(t, tc.form, redact.FormOf(tc.in), "form of %q", tc.in)
			got := redact.String(tc.in)
			require.Equal(t, tc.want, got, "String(%q)", tc.in)
			if tc.secret == "" {
				return
			}
			require.NotContains(t, got, tc.secret)
			secrets := redact.Secrets(tc.in)
			echoes := []string{
				fmt.Sprintf("cannot connect to %s: refused", tc.in),
				fmt.Sprintf("cannot connect to %s: refused", url.QueryEscape(tc.in)),
			}
			if !tc.tail {
				echoes = append(echoes,
					fmt.Sprintf("password %s refused", tc.secret),
					fmt.Sprintf("password %s refused", url.QueryEscape(tc.secret)),
					fmt.Sprintf("password %s refused", url.PathEscape(tc.secret)))
			}
			for _, echo := range echoes {
				scrubbed := redact.Error(errors.New(echo), secrets)
				require.NotContains(t, scrubbed.Error(), tc.secret, "scrubbing %q", echo)
			}
		})
	}
}

func TestError_KeepsTheErrorChain(t *testing.T) {
	t.Parallel()
	err := redact.Error(fmt.Errorf("dial amqp://u:S3cr3t@h: %w", io.EOF), redact.Secrets("amqp://u:S3cr3t@h"))
	require.EqualError(t, err, "dial amqp://u:xxxxx@h: EOF")
	require.ErrorIs(t, err, io.EOF)

	plain := errors.New("nothing secret")
	require.Same(t, plain, redact.Error(plain, []string{"S3cr3t"}))
	require.NoError(t, redact.Error(nil, []string{"S3cr3t"}))
}
