use clap::Parser;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    kuryr_policy::run(kuryr_policy::Config::parse()).await
}
