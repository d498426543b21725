package urlparam_test

import (
	"errors"
	"net/url"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow/internal/urlparam"
)

var table = urlparam.Table{Scheme: "amqp", Groups: []urlparam.Group{
	{Reader: "onceflow", Names: []string{"group", "prefetch"}},
	{Reader: "amqp091-go", Names: []string{"heartbeat"}},
}}

func TestCheck_NamesTheFirstUnknownParameterAndListsTheKnownOnes(t *testing.T) {
	t.Parallel()
	require.NoError(t, table.Check(url.Values{"group": {"g"}, "heartbeat": {"10"}}))
	err := table.Check(url.Values{"zz": {"1"}, "grup": {"x"}, "group": {"g"}})
	require.EqualError(t, err, `unknown query parameter "grup" (amqp:// takes onceflow's group, prefetch; amqp091-go's heartbeat)`)
	var unknown *urlparam.UnknownError
	require.ErrorAs(t, err, &unknown)
	require.Equal(t, "grup", unknown.Param)
}

func TestCheck_OthersPassToTheirReader(t *testing.T) {
	t.Parallel()
	open := urlparam.Table{Scheme: "postgres", Groups: table.Groups[:1], Others: "PostgreSQL run-time settings"}
	require.NoError(t, open.Check(url.Values{"search_path": {"s"}}))
	refused := errors.New(`unrecognized configuration parameter "grup"`)
	err := &urlparam.UnknownError{Param: "grup", Table: open, Cause: refused}
	require.EqualError(t, err, `unknown query parameter "grup" (postgres:// takes onceflow's group, prefetch; and PostgreSQL run-time settings): unrecognized configuration parameter "grup"`)
	require.ErrorIs(t, err, refused)
}

func TestUnder_PutsALayerAboveWithoutRepeatingItsNames(t *testing.T) {
	t.Parallel()
	lower := urlparam.Table{Scheme: "postgres", Groups: []urlparam.Group{
		{Reader: "sqldb", Names: []string{"connect_timeout"}},
		{Reader: "pgx", Names: []string{"sslmode"}},
	}}
	got := lower.Under(urlparam.Group{Reader: "onceflow", Names: []string{"group", "connect_timeout"}})
	require.Equal(t, []urlparam.Group{
		{Reader: "onceflow", Names: []string{"group", "connect_timeout"}},
		{Reader: "pgx", Names: []string{"sslmode"}},
	}, got.Groups)
	require.True(t, got.Has("sslmode"))
	require.False(t, got.Has("grup"))
}
